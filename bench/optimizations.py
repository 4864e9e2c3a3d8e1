"""Determined's optimizations where communication dominates: 2 test hosts x 1 slot over a link limited to
200 Mbit/s (tc tbf), a ~10M-parameter MLP on digits (hidden 3072). Root (network namespaces).

    .venv/bin/python bench/optimizations.py [--rate 200mbit] [--steps 16] [--skip-accuracy]

1. Step time and communication time per step on the link: none, fp16, bf16, powersgd (rank 4, compressing
   from step 2), aggregation_frequency 4. Goals: fp16 comm <= 0.55x none; powersgd step speed-up >= 5x;
   aggregation 4 >= 3x samples/s. The doctor's recommendation for the uncompressed run is printed too.
2. Accuracy: the same model trained to the end on this host (accuracy does not depend on the link),
   uncompressed vs powersgd. Goal: within 1 point.
All cases of a part run back to back; ratios are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
CONFIG = ROOT / "examples" / "digits" / "experiment.yaml"
WIDE = ["hyperparameters.hidden=3072", "hyperparameters.lr=0.02", "min_validation_period=null",
        "min_checkpoint_period=null"]
# Profile whole aggregation groups of 4: steps 5..20 hold exactly 4 exchanges in 16 steps.
LINK = ["profiling.warmup_steps=4"]
CASES = {
    "none": [],
    "fp16": ["optimizations.gradient_compression=fp16"],
    "bf16": ["optimizations.gradient_compression=bf16"],
    "powersgd": ["optimizations.gradient_compression=powersgd", "optimizations.powersgd.rank=4",
                 "optimizations.powersgd.start_iteration=2"],
    "aggregation 4": ["optimizations.aggregation_frequency=4"],
}


def two_hosts(rate: str, tmp: Path, tag: str, steps: int, overrides: list[str]) -> Path:
    """Run the wide digits model on 2 hosts x 1 slot; return the run directory."""
    from link import PORT, _run_pair
    from testhosts import TestHosts

    run_dir = tmp / tag.replace(" ", "-")
    sets = [*WIDE, *LINK, f"max_length={{batches: {steps}}}", *overrides]
    with TestHosts(2, rate=rate, pin_cpus=True) as hosts:
        def argv(i: int) -> list[str]:
            cmd = [sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--slots", "2", "--nnodes", "2",
                   "--node-rank", str(i), "--master", f"{hosts.hostname(0)}:{PORT}", "--run-dir", str(run_dir),
                   "--quiet"]
            for item in sets:
                cmd += ["--set", item]
            return cmd
        _run_pair(hosts, argv, {**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=900)
    return run_dir


def one_host_accuracy(tmp: Path, tag: str, overrides: list[str]) -> float:
    run_dir = tmp / f"acc-{tag}"
    cmd = [sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--quiet", "--run-dir", str(run_dir)]
    for item in [*WIDE, *overrides]:
        cmd += ["--set", item]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=1800)
    return json.loads((run_dir / "summary.json").read_text())["validation"]["accuracy"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--steps", type=int, default=20, help="steps per case on the link (4 are warm-up)")
    parser.add_argument("--skip-accuracy", action="store_true")
    args = parser.parse_args()
    from testhosts import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"bench/optimizations.py: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dtrain-opt-") as tmp:
        profiles = {}
        for name, sets in CASES.items():
            print(f"running {name} ...", file=sys.stderr, flush=True)
            run_dir = two_hosts(args.rate, Path(tmp), name, args.steps, sets)
            profiles[name] = json.loads((run_dir / "profile.json").read_text())
            if name == "none":
                doctor = subprocess.run([sys.executable, "-m", "dtrain.cli", "doctor", str(run_dir)],
                                        capture_output=True, text=True, cwd=ROOT)
                verdict = [doctor.stdout[doctor.stdout.index("verdict"):].replace("\n", " ")]
        base = profiles["none"]
        print(f"## 2 hosts x 1 slot, link {args.rate}, {base['parameters'] / 1e6:.1f}M parameters, "
              f"{args.steps} steps per case")
        print("| case | MB sent/step | comm busy s/step | comm vs none | step s | samples/s | speed-up vs none |")
        print("|---|---|---|---|---|---|---|")
        for name, p in profiles.items():
            comm = p["comm"]["busy_seconds_per_step"]
            step = p["seconds_per_step"]["step"]["mean"]
            print(f"| {name} | {p['comm']['bytes_per_step'] / 1e6:.2f} | {comm:.3f} | "
                  f"{comm / base['comm']['busy_seconds_per_step']:.2f}x | {step:.3f} | "
                  f"{p['samples_per_second']:,.0f} | {p['samples_per_second'] / base['samples_per_second']:.2f}x |")
        print(f"\ndoctor on the uncompressed run: {verdict[0] if verdict else '(no verdict)'}")
        if not args.skip_accuracy:
            print("running accuracy runs on one host ...", file=sys.stderr, flush=True)
            plain = one_host_accuracy(Path(tmp), "none", [])
            compressed = one_host_accuracy(Path(tmp), "powersgd", CASES["powersgd"])
            print(f"\ndigits accuracy after 30 epochs, 2 slots on one host: none {plain:.4f}, "
                  f"powersgd {compressed:.4f} (difference {100 * (compressed - plain):+.2f} points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
