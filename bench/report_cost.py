"""What one training report costs the loop, measured inside a real multi-slot run.

    .venv/bin/python bench/report_cost.py [--slots 2] [--model mlp-0.1m] [--batches 6000] [--unit 100]

A report (every ``scheduling_unit`` batches) closes the time window, reduces the training metrics over
the slots, checks for non-finite losses and writes metrics.jsonl and TensorBoard. Its cost to the loop is
its own time plus whatever it leaves to the next steps (an all-reduce still in flight, ranks pulled out of
step, the read of its result). A loop callback (``dtrain.LoopCallback``) on every rank of one run of the
bench's Trial stamps the end of every step: between two stamps lies one iteration of the loop (what
followed the previous step, then the next step). Reports are held back to the next stop vote's batch and
sent together (one all-reduce now and then), read one step later, where ``on_training_report`` fires for
each report the read carried. So three kinds of iterations: a report's (the report, maybe its send, and
the step overlapping the all-reduce), a read's (the read and the step after it), and plain ones. Per
report: (report's - plain) + (read's - plain) x reads / reports, means over the run after its first report
window. Timing one run's parts side by side avoids bench/overhead.py's launch-to-launch spread.
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

from trials.workload import WorkloadTrial

import dtrain

HERE = Path(__file__).resolve().parent


class ReportClock(dtrain.LoopCallback):
    """Stamps every step end and notes after which step each report was read; prints its figures at the end."""

    def __init__(self, rank: int, unit: int) -> None:
        self.rank, self.unit = rank, unit
        self.ends: list[float] = []  # perf_counter at the end of step b (batches trained: b + 1)
        self.read_after: list[int] = []  # per report read: the batches trained when it was read

    def on_step_end(self, batch_idx: int) -> None:
        self.ends.append(time.perf_counter())

    def on_training_report(self, batches: int, metrics: dict[str, float]) -> None:
        self.read_after.append(len(self.ends))

    def on_trial_shutdown(self) -> None:
        print("FIGURES " + json.dumps(self.figures()), flush=True)

    def figures(self) -> dict[str, Any]:
        # iteration[b]: from the end of step b - 1 to the end of step b (batches counted from 1), for b > unit:
        # the first report window carries one-off costs, and the last report and read follow the last stamp.
        last = len(self.ends)
        iteration = {b: self.ends[b - 1] - self.ends[b - 2] for b in range(self.unit + 2, last + 1)}
        after_report = {r + 1 for r in range(self.unit, last, self.unit)} & iteration.keys()
        after_read = {b + 1 for b in set(self.read_after)} & iteration.keys()
        plain = statistics.mean(s for b, s in iteration.items() if b not in after_report | after_read)
        reports = len(after_report)
        report_extra = sum(iteration[b] - plain for b in after_report) / reports
        read_extra = sum(iteration[b] - plain for b in after_read) / reports
        return {"rank": self.rank, "reports": reports, "reads": len(after_read), "report_ms": 1e3 * report_extra,
                "read_ms": 1e3 * read_extra, "step_ms": 1e3 * plain, "per_report_ms": 1e3 * (report_extra + read_extra)}


class ReportCostTrial(WorkloadTrial):
    def build_callbacks(self) -> dict[str, dtrain.LoopCallback]:
        return {"clock": ReportClock(self.context.rank, self.context.get_hparam("unit"))}


def worker(args: argparse.Namespace) -> None:
    import torch

    from dtrain.config.schema import config_from_dict
    from dtrain.engine.trainer import run_trial

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    config = config_from_dict({
        "name": "report-cost", "entrypoint": "report_cost:ReportCostTrial", "code_dir": str(HERE),
        "hyperparameters": {"global_batch_size": 32 * world, "model": args.model, "unit": args.unit},
        "resources": {"slots_per_trial": world}, "max_length": {"batches": args.batches},
        "scheduling_unit": args.unit, "checkpoint_storage": {"path": "checkpoints"},
    })
    run_trial(config, Path(args.run_dir), None, quiet=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--model", default="mlp-0.1m")
    parser.add_argument("--batches", type=int, default=6000)
    parser.add_argument("--unit", type=int, default=100, help="scheduling_unit: batches per report")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.unit < 3 or args.batches < 3 * args.unit:
        parser.error("--unit must be at least 3 (plain iterations between a report's and a read's) and --batches "
                     "at least 3 report windows (the first is left out)")
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
    print(f"{args.model}, {args.slots} slots, a report every {args.unit} batches; ms over a plain iteration of the "
          "loop, means over the run")
    print("| rank | reports | reads | report's iteration | read's iterations per report | plain iteration "
          "| per report |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rank']} | {r['reports']} | {r['reads']} | {r['report_ms']:.3f} | {r['read_ms']:.3f} "
              f"| {r['step_ms']:.3f} | **{r['per_report_ms']:.3f}** |")


if __name__ == "__main__":
    main()
