"""What one training report costs the loop, measured inside a real multi-slot run.

    .venv/bin/python bench/report_cost.py [--slots 2] [--model mlp-0.1m] [--batches 6000] [--unit 100]
    PYTHONPATH=/tmp/before/src .venv/bin/python bench/report_cost.py   # another commit's trainer

A report (every ``scheduling_unit`` batches) closes the time window, reduces the training metrics over
the slots, checks for non-finite losses and writes metrics.jsonl and TensorBoard. Its cost to the loop is
its own time plus whatever it leaves to the next step (an all-reduce still in flight, ranks pulled out of
step). Both are timed here on every rank, around the trainer's own methods, in one run of the bench's
Trial: the report, the read of its all-reduce where there is one (dtrain at 74aa8a3 and later), and the
step after each all-reduce against the other steps. Since the commit that holds reports back for the next
stop vote's batch, a report sends its all-reduce only now and then (``_send``), and one read writes every
report it carried: the reads and the slower steps are spread over the reports. Per report: report + reads
/ reports + (mean step after a send - mean step) x sends / reports. Timing one run's parts side by side
avoids bench/overhead.py's launch-to-launch spread.
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

    from dtrain.config.schema import config_from_dict
    from dtrain.engine import trainer

    torch.set_num_threads(1)
    reports: list[float] = []
    reads: list[float] = []
    sends: list[int] = []  # the batches at which an all-reduce was launched
    steps: list[tuple[int, float]] = []
    cls = trainer.Trainer
    cls._report_training = timed(reports, cls._report_training)
    if hasattr(cls, "_read_sent"):  # reports held back, sent now and then, read one step later
        send = cls._send

        def recorded_send(self: Any) -> None:
            sends.append(self.batches)
            send(self)

        cls._send = recorded_send
        cls._read_sent = timed(reads, cls._read_sent, only_if=lambda t: t._sent is not None)
    elif hasattr(cls, "_read_report"):  # every report sent, read one step later
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
    sent = set(sends) if sends else {b for b, _ in steps if b % args.unit == 0}  # older trainers: every report
    after = [s for b, s in steps if b > warm and b - 1 in sent]
    others = [s for b, s in steps if b > warm and b - 1 not in sent and b % args.unit]
    n_reports = len(reports)
    figures = {"rank": int(os.environ["RANK"]), "reports": n_reports, "sends": len(sent),
               "report_ms": 1e3 * statistics.mean(reports), "read_ms": 1e3 * sum(reads) / n_reports,
               "step_ms": 1e3 * statistics.mean(others), "step_after_send_ms": 1e3 * statistics.mean(after)}
    figures["per_report_ms"] = (figures["report_ms"] + figures["read_ms"]
                                + (figures["step_after_send_ms"] - figures["step_ms"]) * len(sent) / n_reports)
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
    print("| rank | reports | all-reduces | report | reads per report | step | step after an all-reduce | per report |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rank']} | {r['reports']} | {r['sends']} | {r['report_ms']:.3f} | {r['read_ms']:.3f} "
              f"| {r['step_ms']:.3f} | {r['step_after_send_ms']:.3f} | **{r['per_report_ms']:.3f}** |")


if __name__ == "__main__":
    main()
