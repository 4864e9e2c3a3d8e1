"""End-of-run probes: how a slot's work and its batch loading grow with the batch.

The doctor's one-slot estimate (and ``dtrain plan``) must say what one slot would take for N times the
per-slot batch. Work is not proportional to the batch: a small model's step is mostly per-step overhead
(Python, kernel launches, allocator) that a bigger batch does not grow. So after training, on every
rank at the same point (the probe's forward may hold collectives, as DDP's buffer broadcast), the trial's
own ``train_batch`` runs on the run's per-slot batch and on twice it, without exchanging gradients or
stepping the optimizer, and one batch of each size is loaded in this thread. The ratios, 1 (all
overhead) to 2 (all per-sample), extrapolate linearly to other batch sizes.

Each size runs once untimed (new shapes: autograd and allocator warm-up), then ``repeats`` times
alternating; the minimum counts (the least disturbed by other processes on a shared machine). Weights are
not changed: no optimizer step, and gradients are zeroed again. Skipped (zeros) for strategies with
server ranks, and on any error (a trial that cannot take another batch size).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from dtrain import dist as ddist

PROBE_FIELDS = ("probe_work", "probe_work_double", "probe_load", "probe_load_double", "probe_load_cpu_share",
                "probe_allreduce_bytes", "probe_allreduce_seconds")
# The all-reduce probe moves the gradients' size, at most this many bytes (its rate is what counts).
ALLREDUCE_PROBE_MAX_BYTES = 16 * 2**20
# Rounds of the probe: as many as fit in this many seconds (by the run's last step time), within bounds:
# the minimum of more rounds is less disturbed by other processes, and the probe stays a small cost.
BUDGET_SECONDS = 0.3
MIN_REPEATS, MAX_REPEATS = 1, 15

log = logging.getLogger(__name__)


def _records(dataset: Any, count: int) -> list[Any]:
    size = len(dataset)
    return [dataset[i % size] for i in range(count)]


def _double(batch: Any) -> Any:
    """A batch twice as big, by repeating every tensor along its first dimension."""
    if isinstance(batch, torch.Tensor):
        return torch.cat([batch, batch])
    if isinstance(batch, (list, tuple)):
        return type(batch)(_double(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _double(v) for k, v in batch.items()}
    return batch


def _load(loader: Any, count: int) -> tuple[float, float, Any]:
    """Seconds and CPU seconds (this thread) to read ``count`` records and collate them; the batch."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    batch = loader.collate_fn(_records(loader.dataset, count))
    return time.perf_counter() - start, time.thread_time() - start_cpu, batch


def batch_probe(trainer: Any, repeats: int | None = None) -> dict[str, float]:
    """Per-rank probe figures (``PROBE_FIELDS``, seconds; zeros when not probed). Collective-safe: every
    rank runs the same calls."""
    ctx, trial, loader = trainer.ctx, trainer.trial, trainer.loader
    zeros = dict.fromkeys(PROBE_FIELDS, 0.0)
    if ctx.strategy is None or ctx.strategy.has_server_ranks or not ctx.models:
        return zeros
    per_slot = int(trainer.per_slot)
    if repeats is None:
        last = ctx.timer.last_step_seconds
        repeats = int(max(MIN_REPEATS, min(MAX_REPEATS, BUDGET_SECONDS / (3 * last)))) if last > 0 else MIN_REPEATS
        repeats = _agree(repeats, ctx)
    try:
        _, _, one = _load(loader, per_slot)
        batches = {1: ctx.to_device(one), 2: ctx.to_device(_double(one))}
        work = {1: float("inf"), 2: float("inf")}
        with ctx.gradient_sync(False):  # no exchange, no optimizer step: forward and backward only
            for round_ in range(repeats + 1):
                for size in (1, 2):
                    _sync(ctx.device)
                    start = time.perf_counter()
                    trial.train_batch(batches[size], 0, 0)
                    _sync(ctx.device)
                    if round_:  # the first round warms up each shape
                        work[size] = min(work[size], time.perf_counter() - start)
        out = {"probe_work": work[1], "probe_work_double": work[2]}
        if not trainer.config.data_loader.synthetic:
            loads = {1: float("inf"), 2: float("inf")}
            wall = cpu = 0.0
            for _ in range(MAX_REPEATS):  # rank-local: as many rounds as fit in the budget
                for size in (1, 2):
                    seconds, cpu_seconds, _ = _load(loader, size * per_slot)
                    loads[size] = min(loads[size], seconds)
                    wall, cpu = wall + seconds, cpu + cpu_seconds
                if wall > BUDGET_SECONDS:
                    break
            out.update(probe_load=loads[1], probe_load_double=loads[2],
                       probe_load_cpu_share=min(1.0, cpu / wall) if wall > 0 else 1.0)
        return {**zeros, **out}
    except Exception as exc:  # a trial that cannot take another batch size: no probe, not a failed run
        log.info("batch probe skipped: %s", exc)
        return zeros
    finally:
        ctx.timer.exchanging = True
        for opt in ctx.optimizers:
            opt.zero_grad(set_to_none=True)


def _agree(repeats: int, ctx: Any) -> int:
    """The smallest count over the ranks: the probe may hold collectives, so every rank runs as many."""
    import torch.distributed as dist

    group = ctx.strategy.dp_group
    if not ddist.is_distributed(group):
        return repeats
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    count = torch.tensor([repeats], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
    return int(count.item())


def allreduce_probe(ctx: Any, repeats: int = 5) -> dict[str, float]:
    """Median seconds of a back-to-back all-reduce of the gradients' size (capped): the ring's bytes rate,
    apart from what an exchange costs inside a training step (waking up, waiting for peers). Collective."""
    import torch.distributed as dist

    group = ctx.strategy.dp_group if ctx.strategy is not None else None
    if not ddist.is_distributed(group) or not ctx.models:
        return {}
    nbytes = min(ALLREDUCE_PROBE_MAX_BYTES, 4 * sum(p.numel() for m in ctx.models for p in m.parameters()))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    buffer = torch.zeros(max(1, nbytes // 4), device=device)
    dist.all_reduce(buffer, group=group)  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        if device is not None:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return {"probe_allreduce_bytes": float(buffer.numel() * 4), "probe_allreduce_seconds": sorted(times)[repeats // 2]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
