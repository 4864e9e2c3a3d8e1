"""End-of-run figures across ranks: per-rank step means, memory, link latency, and the ``profile.json`` record."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from dtrain.profiling import commprobe, stragglers
from dtrain.profiling.flops import count_step_flops, mfu_section
from dtrain.profiling.probes import PROBE_FIELDS, SOLO_THREADS, batch_probe
from dtrain.profiling.record import (
    BatchScaling,
    Comm,
    CommPoint,
    CommProbe,
    CompressionCost,
    PhaseSeconds,
    PhaseSpread,
    ProfileRecord,
    RankFigures,
    SoloProbe,
    Spread,
    WorkPoint,
)
from dtrain.profiling.timer import COMM_FIELDS, PHASES, StepTimer

RANK_FIELDS = (*PHASES, "step", "step_std", *COMM_FIELDS, "peak_memory_bytes", "state_bytes", *PROBE_FIELDS,
               "step_flops")


def peak_memory_bytes(device: torch.device) -> float:
    """Peak memory of this rank: the CUDA allocator's peak on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _local_numel_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP's DTensor shards
    return local.numel() * local.element_size()


def state_bytes(models: list[Any], optimizers: list[Any]) -> float:
    """Bytes of parameters and optimizer state this rank holds (1/N of DDP's under FSDP)."""
    total = sum(_local_numel_bytes(p) for m in models for p in m.parameters())
    for opt in optimizers:
        for state in opt.state.values():
            total += sum(_local_numel_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    return float(total)


def _comm_device(group: Any) -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None


def latency_probe(repeats: int = 10, group: Any = None) -> float:
    """Median time of an all-reduce of one float: the per-message cost, independent of bandwidth."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return 0.0
    device = _comm_device(group)
    one = torch.zeros(1, device=device)
    dist.all_reduce(one, group=group)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(one, group=group)
        if device is not None:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def gather_rank_stats(timer: StepTimer, memory: dict[str, float], group: Any = None) -> list[dict[str, float]]:
    """Every rank's per-step means and ``memory`` figures, gathered on all ranks of ``group`` (one small
    all_gather, which also carries each rank's straggler samples: their lag figures are added per rank)."""
    mine = {**timer.per_step(), **memory}
    values = torch.tensor([float(mine.get(f, 0.0)) for f in RANK_FIELDS] + timer.lag.export(), dtype=torch.float64)
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [dict(zip(RANK_FIELDS, values[:len(RANK_FIELDS)].tolist(), strict=True))]
    device = _comm_device(group)
    if device is not None:
        values = values.to(device)
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, values, group=group)
    rows = [g.cpu().tolist() for g in gathered]
    lags = stragglers.rank_figures([row[len(RANK_FIELDS):] for row in rows])
    return [{**dict(zip(RANK_FIELDS, row[:len(RANK_FIELDS)], strict=True)), **lag}
            for row, lag in zip(rows, lags, strict=True)]


def build_profile(per_rank: list[dict[str, float]], hosts: list[str], run: dict[str, Any],
                  latency_seconds: float, comm_points: list[tuple[float, float]] | None = None) -> ProfileRecord:
    """The ``profile.json`` record (:mod:`dtrain.profiling.record`, docs/profile.md) from every rank's
    figures, their hosts and the run's facts (:func:`run_facts`)."""
    slots = len(per_rank)
    fields = (*PHASES, "step")
    spread = PhaseSpread(**{
        field: Spread(min=min(r[field] for r in per_rank), mean=sum(r[field] for r in per_rank) / slots,
                      max=max(r[field] for r in per_rank))
        for field in fields})
    comm_bytes = sum(r["comm_bytes"] for r in per_rank) / slots
    busy = sum(r["comm_busy"] for r in per_rank) / slots
    algbw = comm_bytes / busy if busy > 0 else 0.0
    ranks = [
        RankFigures(rank=i, host=hosts[i] if i < len(hosts) else "",
                    seconds_per_step=PhaseSeconds(**{f: r[f] for f in fields}),
                    comm_busy_seconds_per_step=r["comm_busy"], comm_bytes_per_step=r["comm_bytes"],
                    comm_buckets_per_step=r["comm_buckets"], peak_memory_bytes=r["peak_memory_bytes"],
                    state_bytes=r["state_bytes"])
        for i, r in enumerate(per_rank)
    ]
    comm = Comm(
        bytes_per_step=comm_bytes,
        buckets_per_step=sum(r["comm_buckets"] for r in per_rank) / slots,
        busy_seconds_per_step=busy,
        exposed_seconds_per_step=spread.comm_exposed.mean,
        algbw_bytes_per_second=algbw,
        # A ring all-reduce moves 2(N-1)/N of the buffer through each link: the link's achieved rate.
        busbw_bytes_per_second=algbw * 2 * (slots - 1) / slots if slots > 1 else 0.0,
        latency_seconds=latency_seconds,
    )
    lags = (stragglers.section(per_rank, hosts, spread.step.mean)
            if slots > 1 and "lag_median" in per_rank[0] else None)
    probe = (CommProbe(world=slots, backend=run["backend"],
                       points=[CommPoint(bytes=b, seconds=s) for b, s in comm_points]) if comm_points else None)
    return ProfileRecord(**run, phases=list(PHASES), seconds_per_step=spread, per_rank=ranks, comm=comm,
                         stragglers=lags, comm_probe=probe,
                         step_jitter_seconds=sum(r.get("step_std", 0.0) for r in per_rank) / slots,
                         **_probe_figures(per_rank, run))


def _probe_figures(per_rank: list[dict[str, float]], run: dict[str, Any]) -> dict[str, Any]:
    """The end-of-run probe (:mod:`dtrain.profiling.probes`), means over ranks: the record's probe sections,
    None where not probed."""
    def mean(field: str) -> float:
        return sum(r.get(field, 0.0) for r in per_rank) / len(per_rank)

    batch_scaling: BatchScaling | None = None
    if mean("probe_work") > 0:
        batch_scaling = BatchScaling(
            per_slot_batch_size=run["per_slot_batch_size"], work_seconds=mean("probe_work"),
            work_double_seconds=mean("probe_work_double"), load_seconds=mean("probe_load"),
            load_double_seconds=mean("probe_load_double"))
    first = per_rank[0]  # the solo probe ran on the first rank alone
    points = [WorkPoint(threads=int(first[f"probe_solo{i}_threads"]), work_seconds=first[f"probe_solo{i}_work"],
                        work_double_seconds=first[f"probe_solo{i}_double"])
              for i in range(SOLO_THREADS) if first.get(f"probe_solo{i}_threads", 0.0) > 0]
    solo = SoloProbe(per_slot_batch_size=run["per_slot_batch_size"], points=points) if points else None
    compression = (CompressionCost(fp16_seconds=first["probe_fp16_seconds"],
                                   powersgd_seconds=first["probe_powersgd_seconds"],
                                   powersgd_bytes=first["probe_powersgd_bytes"],
                                   powersgd_rank=int(first["probe_powersgd_rank"]))
                   if first.get("probe_powersgd_bytes", 0.0) > 0 else None)
    probed_load = mean("probe_load") > 0
    return {"batch_scaling": batch_scaling, "solo_probe": solo, "compression_cost": compression,
            "data_load_seconds_per_batch": mean("probe_load") if probed_load else None,
            "data_load_cpu_share": mean("probe_load_cpu_share") if probed_load else None}


def collect_rank_figures(ctx: Any, trainer: Any = None) -> tuple[list[dict[str, float]], float, list[str],
                                                                 list[tuple[float, float]]]:
    """End of a run, on every rank of a DistributedContext: per-rank step figures and memory (training
    slots), the batch probe (given the ``trainer``, when profiling), the all-reduce latency probe, every
    rank's host name, and the all-reduce probe's ``(bytes, seconds)`` (when profiling with several slots).
    Collectives: all ranks call it."""
    from dtrain.dist import all_hostnames

    group = ctx.strategy.dp_group
    memory = {"peak_memory_bytes": peak_memory_bytes(ctx.device),
              "state_bytes": state_bytes(ctx.models, ctx.optimizers)}
    points: list[tuple[float, float]] = []
    if trainer is not None and ctx.timer.enabled:
        memory.update(batch_probe(trainer))
        memory["step_flops"] = count_step_flops(trainer)
        if not ctx.strategy.has_server_ranks:
            points = commprobe.end_of_run(group)
    per_rank = gather_rank_stats(ctx.timer, memory, group)
    latency = latency_probe(group=group)
    return per_rank, latency, all_hostnames(), points


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity: a container's or Slurm's share, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _memory_total() -> float:
    """This host's physical memory (bytes), for batch-size advice on CPU."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def _lr_hyperparameter(hparams: dict[str, Any]) -> dict[str, Any] | None:
    for name in ("lr", "learning_rate"):
        value = hparams.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {"name": name, "value": value}
    return None


def run_facts(trainer: Any, wall_seconds: float, per_rank: list[dict[str, float]] | None = None) -> dict[str, Any]:
    """What a run was and how fast it went: the head of ``summary.json`` and ``profile.json``.

    ``samples_per_second`` is the steady state over profiled steps when profiling (device-timed), else
    every step over the device-synchronized training time; both exclude validation and checkpoints.
    """
    ctx, config, timer = trainer.ctx, trainer.config, trainer.ctx.timer
    gbs, o = trainer.global_batch, config.optimizations
    all_steps = trainer.steps * gbs / trainer.train_seconds if trainer.train_seconds > 0 else 0.0
    steady = timer.profiled_weight * gbs / timer.profiled_seconds if timer.profiled_seconds > 0 else 0.0
    facts = {
        "slots": ctx.strategy.dp_world,
        "strategy": ctx.strategy.name,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "precision": ctx.precision.name,
        "threads_per_slot": ctx.num_threads,
        "cpu_cores": cpu_cores(),
        "memory_total_bytes": _memory_total(),
        # What a batch-size advice needs to keep training equivalent: the optimizer and its learning rate.
        "optimizer": type(getattr(ctx.optimizers[0], "optim", ctx.optimizers[0])).__name__ if ctx.optimizers else None,
        "lr_hyperparameter": _lr_hyperparameter(config.hyperparameters),
        "global_batch_size": gbs,
        "per_slot_batch_size": trainer.per_slot,
        "parameters": sum(p.numel() for m in ctx.models for p in m.parameters()),
        "synthetic_data": config.data_loader.synthetic,
        "data_loader_workers": config.data_loader.num_workers,
        "aggregation_frequency": o.aggregation_frequency,
        "effective_batch_size": gbs * o.aggregation_frequency,
        "gradient_compression": o.gradient_compression,
        "tensor_fusion_threshold_mb": ctx.strategy.fusion_threshold_mb,
        "comm_measured": ctx.strategy.comm_measured,
        # What the doctor may advise: the strategy's capabilities, from the registry's class.
        "strategy_compressions": sorted(ctx.strategy.compressions),
        "profiling": timer.enabled,
        "steps": trainer.steps,
        "profiled_steps": timer.profiled_steps,
        "timed_steps": timer.timed_steps,
        "samples_per_second": steady if timer.enabled and steady > 0 else all_steps,
        "samples_per_second_all_steps": all_steps,
        "train_seconds": trainer.train_seconds,
        "validation_seconds": trainer.validation_seconds,
        "checkpoint_seconds": trainer.checkpoint_seconds,
        "wall_seconds": wall_seconds,
        "step_window_seconds": list(timer.windows) if timer.enabled and timer.windows else None,
    }
    unobserved = getattr(trainer, "unobserved_phases", None)
    if unobserved:  # train_batch calls loss.backward() / opt.step() itself: those phases are in "other"
        facts["unobserved_phases"] = list(unobserved)
    if timer.enabled and ctx.is_chief:
        from dtrain.profiling.device import device_facts

        facts["device_facts"] = device_facts(ctx.device)
    facts.update(_first_steps_and_mfu(trainer, per_rank, facts))
    return facts


def _first_steps_and_mfu(trainer: Any, per_rank: list[dict[str, float]] | None,
                         facts: dict[str, Any]) -> dict[str, Any]:
    """``first_steps`` (dtrain.profiling.warmup) and, on the chief of a profiled run, ``flops`` (MFU)."""
    timer, out = trainer.ctx.timer, {}
    steady = timer.profiled_seconds / timer.profiled_weight if timer.profiled_weight else 0.0
    stamps = getattr(timer, "first_steps", None)
    if stamps is not None and (first := stamps.section(steady)) is not None:
        out["first_steps"] = first
    chief_profiled = bool(per_rank) and timer.enabled and trainer.ctx.is_chief
    if chief_profiled and (flops := mfu_section(per_rank or [], facts["precision"], facts.get("device_facts"))):
        out["flops"] = flops
    return out
