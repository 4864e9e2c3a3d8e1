"""What dtrain's step loop itself costs per step, in microseconds: no model, no data, one process.

    .venv/bin/python bench/loop_cost.py [--steps 100000] [--repeats 3]

The trainer runs a Trial whose ``train_batch`` only returns a constant CPU loss, and its next batch is
one batch kept aside (``data_loader.synthetic``: the loader is not what is measured), so what remains per
step is dtrain's own work: the schedule, the rank status, the step profiler's phase edges and their
resolution, the metric check and accumulation, the non-finite watch, and, every ``scheduling_unit``
steps, a report (metrics.jsonl, TensorBoard, the step breakdown). One variant adds a loop callback
(``dtrain.LoopCallback``) whose ``on_step_end`` does nothing: what the per-step hook costs. Each variant runs
``--repeats`` times, alternating; the table gives the minimum and median microseconds per step of
training time (``train_seconds`` over steps), next to a bare Python loop calling the same function.
Context-free timing on a quiet machine: run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
VARIANTS = {
    "as configured by default": {},
    "a no-op on_step_end callback": {"hyperparameters": {"global_batch_size": 1, "step_callback": True}},
    "profiling off": {"profiling": {"enabled": False}},
    "reports off": {"scheduling_unit": 10**9},
    "profiling and reports off": {"profiling": {"enabled": False}, "scheduling_unit": 10**9},
}


def trainer_seconds_per_step(steps: int, extra: dict[str, Any]) -> float:
    from dtrain.config.schema import config_from_dict
    from dtrain.engine import trainer

    config = config_from_dict({
        "name": "loop-cost", "entrypoint": "trials.constant:ConstantTrial", "code_dir": str(HERE),
        "hyperparameters": {"global_batch_size": 1}, "resources": {"slots_per_trial": 1},
        "max_length": {"batches": steps}, "checkpoint_storage": {"path": "checkpoints"},
        "data_loader": {"synthetic": True}, **extra,
    })
    with tempfile.TemporaryDirectory() as run_dir:
        summary = trainer.run_trial(config, Path(run_dir), None, quiet=True)
    return float(summary["train_seconds"]) / steps


def bare_seconds_per_step(steps: int) -> float:
    loss = torch.tensor(0.5)

    def train_batch(batch: Any, epoch: int, index: int) -> dict[str, Any]:
        return {"loss": loss}

    start = time.perf_counter()
    for index in range(steps):
        train_batch(None, 0, index)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29871", "DTRAIN_REPORT": "0"})
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {name: [] for name in [*VARIANTS, "bare Python loop"]}
    for _ in range(args.repeats):
        for name, extra in VARIANTS.items():
            times[name].append(trainer_seconds_per_step(args.steps, extra))
        times["bare Python loop"].append(bare_seconds_per_step(args.steps))
    print(f"dtrain's step loop, {args.steps:,} steps, {args.repeats} repeats, torch {torch.__version__}\n")
    print("| variant | us/step (min) | us/step (median) |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {1e6 * min(values):.2f} | {1e6 * statistics.median(values):.2f} |")
    print(json.dumps({k: [round(1e6 * v, 3) for v in vs] for k, vs in times.items()}), file=sys.stderr)


if __name__ == "__main__":
    main()
