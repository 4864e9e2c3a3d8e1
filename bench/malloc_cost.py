"""What glibc malloc's defaults cost a CPU training step, next to dtrain's raised thresholds
(src/dtrain/engine/hostmemory.py), measured side by side.

    .venv/bin/python bench/malloc_cost.py [--model mlp-1m] [--steps 600] [--rounds 5] [--threads 2]

A plain loop (DataLoader, autocast around the forward where bf16-mixed, loss, backward, SGD step,
``zero_grad(set_to_none=True)``) trains bench/models.py's model in a fresh process per measurement, once
with glibc's defaults and once after ``hostmemory.keep_freed_memory()``: malloc's state is per process, so
each variant needs its own. Each round runs every (precision, allocator) pair once, the order rotating; a
round's ratio compares two processes seconds apart. The table gives the median ms per step and page faults
per step of each pair, and the median and range over rounds of the paired speed-up (default time over kept).
Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PRECISIONS = ("32-true", "bf16-mixed")
ALLOCATORS = ("glibc defaults", "kept (dtrain)")
WARMUP_STEPS = 50


def train(model_name: str, precision: str, keep: bool, steps: int, threads: int) -> dict[str, float]:
    """In the measuring process: ``steps`` timed steps after a warm-up; ms per step and page faults per step."""
    import resource

    import torch
    from torch.nn import functional
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(HERE))
    from models import mlp, mlp_data

    from dtrain.engine import hostmemory

    if keep and not hostmemory.keep_freed_memory():
        raise SystemExit("the thresholds could not be raised on this host (not glibc, or MALLOC_* set)")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = mlp(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(mlp_data(model_name), batch_size=256, shuffle=True, drop_last=True)
    bf16 = precision == "bf16-mixed"
    batches = (batch for _ in itertools.count() for batch in loader)
    start = faults = 0.0
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            start, faults = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x, y = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(x)
        functional.cross_entropy(out.float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    return {"ms_per_step": 1000 * seconds / steps,
            "faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps}


def measure(args: argparse.Namespace, precision: str, keep: bool) -> dict[str, float]:
    command = [sys.executable, __file__, "--worker", precision, "keep" if keep else "default", "--model", args.model,
               "--steps", str(args.steps), "--threads", str(args.threads)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp-1m")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", nargs=2, metavar=("PRECISION", "ALLOCATOR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        precision, allocator = args.worker
        print(json.dumps(train(args.model, precision, allocator == "keep", args.steps, args.threads)))
        return
    pairs = [(p, keep) for p in PRECISIONS for keep in (False, True)]
    results: dict[tuple[str, bool], list[dict[str, float]]] = {pair: [] for pair in pairs}
    for k in range(args.rounds):
        for pair in pairs[k % len(pairs):] + pairs[:k % len(pairs)]:
            results[pair].append(measure(args, *pair))
    print(f"{args.model}, batch 256, {args.threads} threads, {args.steps} steps per process, {args.rounds} rounds")
    print("| precision | allocator | ms per step (median) | page faults per step | speed-up, median (range) |")
    print("|---|---|---|---|---|")
    for precision in PRECISIONS:
        default, kept = results[(precision, False)], results[(precision, True)]
        ratios = [d["ms_per_step"] / k["ms_per_step"] for d, k in zip(default, kept, strict=True)]
        for keep, rows in ((False, default), (True, kept)):
            ms = statistics.median(r["ms_per_step"] for r in rows)
            faults = statistics.median(r["faults_per_step"] for r in rows)
            gain = (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if keep else "")
            print(f"| {precision} | {ALLOCATORS[keep]} | {ms:.2f} | {faults:.0f} | {gain} |")


if __name__ == "__main__":
    main()
