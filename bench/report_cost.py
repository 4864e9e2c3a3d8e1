"""What one training report costs the loop, measured inside a real multi-slot run.

    .venv/bin/python bench/report_cost.py [--slots 2] [--model mlp-0.1m] [--batches 6000] [--unit 100]
    PYTHONPATH=/tmp/before/src .venv/bin/python bench/report_cost.py   # another commit's trainer

A report (every ``scheduling_unit`` batches) closes the time window, reduces the training metrics over
the slots, checks for non-finite losses and writes metrics.jsonl and TensorBoard. Its cost to the loop is
its own time plus whatever it leaves to the next step (an all-reduce still in flight, ranks pulled out of
step). Both are timed here on every rank, around the trainer's own methods, in one run of the bench's
Trial: the report, the read of its all-reduce where there is one (dtrain at 74aa8a3 and later), and the
step after each report against the median step. Per report: report + read + (mean step after a report -
mean step). Timing one run's parts side by side avoids bench/overhead.py's launch-to-launch spread.
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
from typing import Any

HERE = Path(__file__).resolve().parent


def timed(record: list[float], method: Any, only_if: Any = None) -> Any:
    """``method`` with its duration appended to ``record`` (when ``only_if(self)`` held before the call)."""

    def wrapper(self: Any) -> None:
        counts = only_if is None or only_if(self)
        start = time.perf_counter()
        method(self)
        if counts:
            record.append(time.perf_counter() - start)

    return wrapper


def worker(args: argparse.Namespace) -> None:
    import torch

    from dtrain import trainer
    from dtrain.config import config_from_dict

    torch.set_num_threads(1)
    reports: list[float] = []
    reads: list[float] = []
    steps: list[tuple[int, float]] = []
    cls = trainer.Trainer
    cls._report_training = timed(reports, cls._report_training)
    if hasattr(cls, "_read_report"):  # a report read one step later: only reads of a pending one count
        cls._read_report = timed(reads, cls._read_report, only_if=lambda t: t._report is not None)
    step = cls._train_step

    def timed_step(self: Any) -> None:
        start = time.perf_counter()
        step(self)
        steps.append((self.batches, time.perf_counter() - start))

    cls._train_step = timed_step
    world = int(os.environ["WORLD_SIZE"])
    config = config_from_dict({
        "name": "report-cost", "entrypoint": "trials.workload:WorkloadTrial", "code_dir": str(HERE),
        "hyperparameters": {"global_batch_size": 32 * world, "model": args.model},
        "resources": {"slots_per_trial": world}, "max_length": {"batches": args.batches},
        "scheduling_unit": args.unit, "checkpoint_storage": {"path": "checkpoints"},
    })
    trainer.run_trial(config, Path(args.run_dir), None, quiet=True)
    warm = args.unit  # the first report window carries one-off costs
    after = [s for b, s in steps if b > warm and b % args.unit == 1]
    others = [s for b, s in steps if b > warm and b % args.unit not in (0, 1)]
    figures = {"rank": int(os.environ["RANK"]), "reports": len(reports),
               "report_ms": 1e3 * statistics.mean(reports), "read_ms": 1e3 * statistics.mean(reads) if reads else 0.0,
               "step_ms": 1e3 * statistics.mean(others), "step_after_report_ms": 1e3 * statistics.mean(after)}
    figures["per_report_ms"] = (figures["report_ms"] + figures["read_ms"]
                                + figures["step_after_report_ms"] - figures["step_ms"])
    print("FIGURES " + json.dumps(figures), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--model", default="mlp-0.1m")
    parser.add_argument("--batches", type=int, default=6000)
    parser.add_argument("--unit", type=int, default=100, help="scheduling_unit: batches per report")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(HERE)) if p)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.slots),
               __file__, "--worker", "--model", args.model, "--batches", str(args.batches), "--unit", str(args.unit),
               "--run-dir", run_dir]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    rows = sorted((json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines()
                   if line.startswith("FIGURES ")), key=lambda r: r["rank"])
    if out.returncode != 0 or not rows:
        raise SystemExit(f"the run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    print(f"{args.model}, {args.slots} slots, a report every {args.unit} batches; ms, means over the run")
    print("| rank | reports | report | read | step | step after a report | per report |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rank']} | {r['reports']} | {r['report_ms']:.3f} | {r['read_ms']:.3f} | {r['step_ms']:.3f} "
              f"| {r['step_after_report_ms']:.3f} | **{r['per_report_ms']:.3f}** |")


if __name__ == "__main__":
    main()
