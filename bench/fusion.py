"""Tensor fusion on a model of 200 small tensors (8 MB of gradients), 2 slots on this host.

    .venv/bin/python bench/fusion.py [--steps 60] [--auto-steps 1000] [--part comm|auto|all]

1. Communication time per step (profile: union of all-reduce intervals) at several fusion thresholds,
   against one all-reduce of the same 8 MB measured in the same run (goal: fused <= 1.3x).
2. An exhaustive sweep of thresholds (samples/s) against ``auto_tune_tensor_fusion`` over a longer run,
   tuning cost included (goal: auto-tuned >= 0.95x the best of the sweep).
All cases run back to back, so their ratios are comparable even though absolute times drift here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "bench" / "trials" / "many_tensors.yaml"
SWEEP_MB = [0.0, 0.05, 0.5, 2.0, 8.0, 64.0]


def run(tmp: Path, tag: str, steps: int, overrides: list[str]) -> dict:
    run_dir = tmp / tag
    cmd = [sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--quiet", "--run-dir", str(run_dir),
           "--set", f"max_length={{batches: {steps}}}"]
    for item in overrides:
        cmd += ["--set", item]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=900)
    profile = json.loads((run_dir / "profile.json").read_text())
    tuning = run_dir / "fusion_tuning.json"
    profile["fusion_tuning"] = json.loads(tuning.read_text()) if tuning.exists() else None
    return profile


def one_allreduce_seconds(nbytes: int, repeats: int = 15) -> float:
    """Median time of one all-reduce of ``nbytes`` between 2 local processes (Gloo), via torchrun."""
    script = (
        "import time, torch, torch.distributed as dist\n"
        "torch.set_num_threads(1); dist.init_process_group('gloo')\n"
        f"t = torch.ones({nbytes // 4}); dist.all_reduce(t); times = []\n"
        f"for _ in range({repeats}):\n"
        "    dist.barrier(); s = time.perf_counter(); dist.all_reduce(t); times.append(time.perf_counter() - s)\n"
        "if dist.get_rank() == 0: print(sorted(times)[len(times) // 2])\n"
        "dist.destroy_process_group()\n")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "--no-python", sys.executable, "-c", script],
                         check=True, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return float(out.stdout.strip().splitlines()[-1])


def part_comm(base: Path, steps: int) -> None:
    reference = one_allreduce_seconds(200 * 10000 * 4)
    print(f"one all-reduce of 8.0 MB (2 local processes, Gloo), median: {1e3 * reference:.2f} ms\n")
    print("## Communication per step vs fusion threshold")
    print("| tensor_fusion_threshold | all-reduces per step | comm busy ms/step | ratio to one all-reduce |")
    print("|---|---|---|---|")
    for mb in SWEEP_MB:
        p = run(base, f"comm-{mb}", steps, [f"optimizations.tensor_fusion_threshold={mb}"])
        busy = p["comm"]["busy_seconds_per_step"]
        print(f"| {mb} MB | {p['comm']['buckets_per_step']:.0f} | {1e3 * busy:.2f} | {busy / reference:.2f}x |",
              flush=True)


def part_auto(base: Path, steps: int) -> None:
    print(f"\n## Exhaustive sweep vs auto-tune ({steps} steps each)")
    sweep = {}
    for mb in SWEEP_MB:
        sweep[mb] = run(base, f"sweep-{mb}", steps, [f"optimizations.tensor_fusion_threshold={mb}"])[
            "samples_per_second_all_steps"]
    # The tuner's own default candidates ([1, 4, 16, 64] MB and the configured threshold).
    auto = run(base, "auto", steps, ["optimizations.auto_tune_tensor_fusion=true"])
    tuning = auto["fusion_tuning"]
    after = ((auto["steps"] - tuning["tuning_steps"]) * auto["global_batch_size"]
             / (auto["train_seconds"] - tuning["tuning_seconds"]))
    best_mb = max(sweep, key=sweep.get)
    print("| setting | samples/s (every step) |")
    print("|---|---|")
    for mb, sps in sweep.items():
        print(f"| {mb} MB{' (best)' if mb == best_mb else ''} | {sps:,.0f} |")
    print(f"| auto-tune: chose {tuning['chosen_mb']} MB after {tuning['tuning_steps']} steps; tuning cost "
          f"{tuning['tuning_cost_seconds']:.2f} s = {100 * tuning['cost_vs_1000_steps']:.1f}% of 1000 steps | "
          f"{auto['samples_per_second_all_steps']:,.0f} (after tuning: {after:,.0f}) |")
    ratio = auto["samples_per_second_all_steps"] / sweep[best_mb]
    print(f"\nauto-tuned / best of sweep: {ratio:.3f} over every step, {after / sweep[best_mb]:.3f} after tuning "
          f"(goal >= 0.95); median of the sweep {statistics.median(sweep.values()):,.0f} samples/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="steps per threshold in part 1")
    parser.add_argument("--auto-steps", type=int, default=1000, help="steps per run in part 2")
    parser.add_argument("--part", choices=["comm", "auto", "all"], default="all")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dtrain-fusion-") as tmp:
        if args.part in ("comm", "all"):
            part_comm(Path(tmp), args.steps)
        if args.part in ("auto", "all"):
            part_auto(Path(tmp), args.auto_steps)


if __name__ == "__main__":
    main()
