"""What the end-of-run probes cost a run: the same short run with ``profiling.probes`` on and off, side by side.

    .venv/bin/python bench/probe_cost.py [--rounds 5] [--steps 100] [--slots 2] [--config CONFIG ...]

A ``dtrain doctor --verify`` round is such a short run, and a search trial's segment another: both read only
the run's samples/s, so they turn the probes off (``explain.verify``, ``search.runner``). Each round runs every
config with the probes on and off, in alternating order (drift on a shared machine hits both alike), and
times the whole ``dtrain run`` process. Reported per config: the median seconds per run on and off, the
median of the paired differences with their range, and the probes' own figure where the run wrote one
(``model_steps.cost_seconds``: the model-step probe alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [ROOT / "examples" / "digits" / "experiment.yaml", ROOT / "bench" / "trials" / "mlp1m.yaml"]


def run(config: Path, probes: bool, steps: int, slots: int, run_dir: Path) -> tuple[float, float | None]:
    """Wall seconds of one ``dtrain run`` process, and its model-step probe's own cost (None: not probed)."""
    cmd = [sys.executable, "-m", "dtrain.cli", "run", str(config), "--quiet", "--run-dir", str(run_dir),
           "--slots", str(slots), "--set", f"max_length={{batches: {steps}}}", "--set", "min_validation_period=null",
           "--set", "min_checkpoint_period=null", "--set", f"scheduling_unit={steps}",
           "--set", f"profiling.probes={str(probes).lower()}"]
    start = time.perf_counter()
    # The report page is left out: its matplotlib time is the same either way, and would blur the difference.
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=900,
                   env={**os.environ, "DTRAIN_REPORT": "0"})
    wall = time.perf_counter() - start
    steps_probe = json.loads((run_dir / "profile.json").read_text()).get("model_steps") or {}
    return wall, steps_probe.get("cost_seconds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, action="append", help="experiment YAML (repeatable; default: "
                        "the digits example and bench/trials/mlp1m.yaml)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="batches per run (a --verify round's default)")
    parser.add_argument("--slots", type=int, default=2)
    args = parser.parse_args()
    configs = args.config or CONFIGS
    walls: dict[tuple[str, bool], list[float]] = {}
    costs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for config in configs:
                for probes in ((True, False) if r % 2 == 0 else (False, True)):
                    wall, cost = run(config, probes, args.steps, args.slots,
                                     Path(tmp) / f"{config.stem}-{probes}-{r}")
                    walls.setdefault((config.stem, probes), []).append(wall)
                    if cost is not None:
                        costs.setdefault(config.stem, []).append(cost)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\n{args.slots} slot(s), {args.steps} batches per run, {args.rounds} rounds")
    print("| config | run, probes on (s) | run, probes off (s) | on - off, paired (range) | model-step probe (s) |")
    print("|---|---|---|---|---|")
    for config in configs:
        name = yaml.safe_load(config.read_text()).get("name", config.stem)
        on, off = walls[(config.stem, True)], walls[(config.stem, False)]
        diffs = [a - b for a, b in zip(on, off, strict=True)]
        probe = f"{statistics.median(costs[config.stem]):.2f}" if costs.get(config.stem) else "-"
        print(f"| {name} | {statistics.median(on):.2f} | {statistics.median(off):.2f} | "
              f"{statistics.median(diffs):.2f} ({min(diffs):.2f} to {max(diffs):.2f}) | {probe} |")


if __name__ == "__main__":
    main()
