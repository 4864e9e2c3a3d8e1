"""Profiler overhead: throughput with the step profiler on vs off, measured side by side.

    .venv/bin/python bench/profiler_overhead.py [--config examples/digits/experiment.yaml] [--repeats 5]

Runs the same experiment alternately with ``profiling.enabled`` true and false (ABAB..., so drift on a
shared machine hits both alike) and compares samples/s over all training steps (step time only: process
start-up, validation and checkpoints are excluded). The goal is on/off >= 0.98.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(config: Path, enabled: bool, run_dir: Path, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "dtrain.cli", "run", str(config), "--quiet", "--run-dir", str(run_dir),
           "--set", f"profiling.enabled={str(enabled).lower()}", "--set", "min_validation_period=null",
           "--set", "min_checkpoint_period=null"]
    for item in extra:
        cmd += ["--set", item]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=600)
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["samples_per_second_all_steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "digits" / "experiment.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--set", dest="extra", action="append", default=[], help="extra config overrides")
    args = parser.parse_args()
    on, off = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            on.append(run(args.config, True, Path(tmp) / f"on{i}", args.extra))
            off.append(run(args.config, False, Path(tmp) / f"off{i}", args.extra))
            print(f"repeat {i}: on {on[-1]:,.0f} samples/s, off {off[-1]:,.0f} samples/s, ratio {on[-1] / off[-1]:.3f}",
                  flush=True)
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    print(f"median samples/s: on {statistics.median(on):,.0f}, off {statistics.median(off):,.0f}; "
          f"on/off median of pairwise ratios {statistics.median(ratios):.3f} "
          f"(overhead {100 * (1 - statistics.median(ratios)):.1f}%, goal <= 2%)")


if __name__ == "__main__":
    main()
