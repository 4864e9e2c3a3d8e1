"""End-of-run figures across ranks: per-rank step means, memory, link latency, and the ``profile.json`` record."""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from dtrain.profiling import commprobe, stragglers
from dtrain.profiling.buckets import gradient_bytes
from dtrain.profiling.device import cpu_cores, device_facts
from dtrain.profiling.flops import count_step_flops, mfu_section
from dtrain.profiling.handoff import MAX_WORKERS
from dtrain.profiling.probeguard import ProbeGuard, time_budget
from dtrain.profiling.probes import PROBE_FIELDS, SOLO_THREADS, batch_probe, no_buffer_broadcast
from dtrain.profiling.record import (
    BatchScaling,
    Comm,
    CommPoint,
    CommProbe,
    CompressionCost,
    LrHyperparameter,
    ModelSteps,
    PhaseSeconds,
    PhaseSpread,
    ProbeSkip,
    ProfileRecord,
    RankFigures,
    ShardedExchange,
    SoloProbe,
    Spread,
    WorkPoint,
)
from dtrain.profiling.runfacts import RunFacts
from dtrain.profiling.runsummary import RunHead
from dtrain.profiling.timer import COMM_FIELDS, PHASES, StepTimer
from dtrain.profiling.warmup import first_steps_of

log = logging.getLogger(__name__)

RANK_FIELDS = (*PHASES, "step", "step_std", *COMM_FIELDS, "peak_memory_bytes", "state_bytes", *PROBE_FIELDS,
               "step_flops")


def peak_memory_bytes(device: torch.device) -> float:
    """Peak memory of this rank: the CUDA allocator's peak on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _local_numel_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP's DTensor shards
    return local.numel() * local.element_size()


def state_bytes(models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> float:
    """Bytes of parameters and optimizer state this rank holds (1/N of DDP's under FSDP)."""
    total = sum(_local_numel_bytes(p) for m in models for p in m.parameters())
    for opt in optimizers:
        for state in opt.state.values():
            total += sum(_local_numel_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    return float(total)


def _comm_device(group: ProcessGroup | None) -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None


def latency_probe(repeats: int = 10, group: ProcessGroup | None = None) -> float:
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


def gather_rank_stats(timer: StepTimer, memory: dict[str, float],
                      group: ProcessGroup | None = None) -> list[dict[str, float]]:
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


@dataclass(frozen=True)
class EndFigures:
    """What every rank gathered at the end of a run (:func:`collect_rank_figures`): each rank's figures, the
    hosts, the one-float all-reduce's latency, the all-reduce probe's ``(bytes, seconds)`` points, and the
    first rank's timed model steps (:mod:`dtrain.profiling.modelsteps`; None where not probed)."""

    per_rank: list[dict[str, float]]
    latency_seconds: float
    hosts: list[str]
    comm_points: list[tuple[float, float]]
    model_steps: ModelSteps | None = None
    gradient_bytes: list[list[int]] | None = None
    probe_seconds: float | None = None  # the probes' wall time on this rank (None: not probed)
    half_points: list[tuple[float, float]] | None = None  # the probe's fp16 all-reduces (bytes as sent)
    probes_skipped: list[ProbeSkip] | None = None  # what every rank skipped, and why (None: not probed)


def build_profile(figures: EndFigures, head: RunHead) -> ProfileRecord:
    """The ``profile.json`` record (:mod:`dtrain.profiling.record`, docs/profile.md) from every rank's
    figures and the run's head (:func:`run_head`)."""
    per_rank, hosts = figures.per_rank, figures.hosts
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
        latency_seconds=figures.latency_seconds,
    )
    lags = (stragglers.section(per_rank, hosts, spread.step.mean)
            if slots > 1 and "lag_median" in per_rank[0] else None)
    probe = (CommProbe(world=slots, backend=head.backend,
                       points=[CommPoint(bytes=b, seconds=s) for b, s in figures.comm_points],
                       half_points=[CommPoint(bytes=b, seconds=s) for b, s in figures.half_points or ()])
             if figures.comm_points else None)
    run = {name: getattr(head, name) for name in RunHead.model_fields}
    return ProfileRecord(**run, phases=list(PHASES), seconds_per_step=spread, per_rank=ranks, comm=comm,
                         stragglers=lags, comm_probe=probe,
                         step_jitter_seconds=sum(r.get("step_std", 0.0) for r in per_rank) / slots,
                         model_steps=figures.model_steps, gradient_bytes=figures.gradient_bytes,
                         probe_seconds=figures.probe_seconds, probes_skipped=figures.probes_skipped,
                         **_probe_figures(per_rank, head.per_slot_batch_size))


def _probe_figures(per_rank: list[dict[str, float]], per_slot: int) -> dict[str, Any]:
    """The end-of-run probe (:mod:`dtrain.profiling.probes`), means over ranks (the loading figures: the rank
    slowest to load a batch's, which a synchronous step waits for; in a balanced run ranks load alike): the
    record's probe sections, None where not probed."""
    def mean(field: str) -> float:
        return sum(r.get(field, 0.0) for r in per_rank) / len(per_rank)

    loading = max(per_rank, key=lambda r: r.get("probe_load", 0.0))

    def loaded(field: str) -> float:
        return loading.get(field, 0.0)

    batch_scaling: BatchScaling | None = None
    if mean("probe_work") > 0 and mean("probe_work_double") > 0:  # (twice the batch not tried on a full GPU)
        batch_scaling = BatchScaling(
            per_slot_batch_size=per_slot, work_seconds=mean("probe_work"),
            work_double_seconds=mean("probe_work_double"), load_seconds=loaded("probe_load"),
            load_double_seconds=loaded("probe_load_double"), optimizer_seconds=mean("probe_optimizer"))
    first = per_rank[0]  # the solo probe ran on the first rank alone
    points = [WorkPoint(threads=int(first[f"probe_solo{i}_threads"]), work_seconds=first[f"probe_solo{i}_work"],
                        work_double_seconds=first[f"probe_solo{i}_double"],
                        optimizer_seconds=first[f"probe_solo{i}_optimizer"])
              for i in range(SOLO_THREADS) if first.get(f"probe_solo{i}_threads", 0.0) > 0]
    solo = SoloProbe(per_slot_batch_size=per_slot, points=points) if points else None
    compression = (CompressionCost(fp16_seconds=first["probe_fp16_seconds"],
                                   powersgd_seconds=first["probe_powersgd_seconds"],
                                   powersgd_bytes=first["probe_powersgd_bytes"],
                                   powersgd_rank=int(first["probe_powersgd_rank"]))
                   if first.get("probe_powersgd_bytes", 0.0) > 0 else None)
    probed_load = loaded("probe_load") > 0
    crowded = _crowded(per_rank)
    counted = mean("probe_sharded_collectives") > 0
    sharded = (ShardedExchange(step_seconds=mean("probe_sharded_step"), local_seconds=mean("probe_sharded_local"),
                               collectives=round(mean("probe_sharded_collectives")) if counted else None,
                               collective_bytes=mean("probe_sharded_bytes") if counted else None)
               if all(r.get("probe_sharded_local", 0.0) > 0 for r in per_rank) else None)
    return {"batch_scaling": batch_scaling, "solo_probe": solo, "compression_cost": compression,
            "sharded_exchange": sharded,
            "data_load_seconds_per_batch": loaded("probe_load") if probed_load else None,
            "data_load_cpu_share": loaded("probe_load_cpu_share") if probed_load else None,
            "data_handoff_seconds_per_batch": loaded("probe_handoff") if loaded("probe_handoff") > 0 else None,
            "data_handoff_cpu_seconds_per_batch": loaded("probe_handoff_cpu") if loaded("probe_handoff") > 0 else None,
            "data_crowded_step_seconds": crowded,
            "data_crowded_own_step_seconds": mean("probe_crowd_own") if crowded else None,
            "data_crowded_none_step_seconds": _timed_by_all(per_rank, "probe_crowd0") if crowded else None}


def _crowded(per_rank: list[dict[str, float]]) -> list[float] | None:
    """The crowded loader probe's steps with 1, 2, ... loader processes (means over ranks; 0 for a count not every
    rank timed: the probe times the most first, as far as its budget goes), up to the most every rank timed (none
    without the step with the run's own, their scale)."""
    if _timed_by_all(per_rank, "probe_crowd_own") is None:
        return None
    steps = [_timed_by_all(per_rank, f"probe_crowd{w}") or 0.0 for w in range(1, MAX_WORKERS + 1)]
    while steps and steps[-1] == 0.0:
        steps.pop()
    return steps or None


def _timed_by_all(per_rank: list[dict[str, float]], key: str) -> float | None:
    """The mean over ranks of a crowded probe's step, None unless every rank timed it."""
    if not all(r.get(key, 0.0) > 0 for r in per_rank):
        return None
    return sum(r[key] for r in per_rank) / len(per_rank)


def collect_rank_figures(facts: RunFacts) -> EndFigures:
    """End of a run, on every rank: per-rank step figures and memory (training slots), the end-of-run
    probes (when profiling with ``profiling.probes``, given the trial's hooks), the all-reduce latency probe,
    every rank's host name, and the all-reduce probe's points (when profiling with several slots) and the
    step's FLOPs (when profiling). Collectives: all ranks call it."""
    from dtrain.dist import all_hostnames

    group, timer = facts.strategy.dp_group, facts.timer
    memory = {"peak_memory_bytes": peak_memory_bytes(facts.device),
              "state_bytes": state_bytes(facts.models, facts.optimizers)}
    points: list[tuple[float, float]] = []
    half: list[tuple[float, float]] = []
    steps: ModelSteps | None = None
    started, probed_for = time.perf_counter(), None
    skipped: list[ProbeSkip] | None = None
    if facts.probe is not None and timer.enabled and facts.probes:
        # Every probe a stage every rank agrees on (dtrain.profiling.probeguard), within the probes' time budget.
        guard = ProbeGuard(facts.strategy.dp_group, time_budget(facts.train_seconds), facts.stop_requested)
        guard.start()
        probed = batch_probe(facts, guard)
        memory.update(probed.figures)
        steps = probed.model_steps
        if steps is not None:  # this rank's loop, beside this rank's probe: the doctor weighs one against the other
            steps = steps.model_copy(update={"loop_data_host_seconds": timer.per_step()["data_host"]})
        if not facts.strategy.has_server_ranks:
            points, half = commprobe.end_of_run(group, guard)
        probed_for = time.perf_counter() - started
        skipped = guard.skipped
        if skipped and facts.is_chief:
            log.warning("end-of-run probes skipped (the run and its outputs are whole; the doctor prices fewer "
                        "changes): %s", "; ".join(f"{s.probe}: {s.reason}" for s in skipped))
    if facts.probe is not None and timer.enabled:  # MFU's count, with the probes off too
        with no_buffer_broadcast(facts.models):  # its forward on this rank alone: no collective inside
            memory["step_flops"] = count_step_flops(facts)
    per_rank = gather_rank_stats(timer, memory, group)
    return EndFigures(per_rank, latency_probe(group=group), all_hostnames(), points, steps,
                      gradient_bytes(facts.models), probed_for, half, skipped)



def _memory_total() -> float:
    """This host's physical memory (bytes), for batch-size advice on CPU."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def _lr_hyperparameter(hparams: Mapping[str, object]) -> tuple[str, int | float] | None:
    for name in ("lr", "learning_rate"):
        value = hparams.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return name, value
    return None


def run_head(facts: RunFacts, figures: EndFigures | None = None) -> RunHead:
    """What a run was and how fast it went: the head of ``summary.json`` and ``profile.json``
    (:class:`dtrain.profiling.runsummary.RunHead` says what each figure means); MFU from the ``figures``."""
    timer, strategy, gbs = facts.timer, facts.strategy, facts.global_batch_size
    all_steps = facts.steps * gbs / facts.train_seconds if facts.train_seconds > 0 else 0.0
    steady = timer.profiled_weight * gbs / timer.profiled_seconds if timer.profiled_seconds > 0 else 0.0
    samples_per_second = steady if timer.enabled and steady > 0 else all_steps
    lr = _lr_hyperparameter(facts.hyperparameters)
    device = device_facts(facts.device) if timer.enabled and facts.is_chief else None
    return RunHead(
        slots=strategy.dp_world, strategy=strategy.name, backend=facts.backend, device=facts.device.type,
        precision=facts.precision, threads_per_slot=facts.threads_per_slot, cpu_cores=cpu_cores(),
        memory_total_bytes=_memory_total(), optimizer=facts.optimizer_name,
        lr_hyperparameter=LrHyperparameter(name=lr[0], value=lr[1]) if lr is not None else None,
        global_batch_size=gbs, per_slot_batch_size=facts.per_slot_batch_size,
        parameters=sum(p.numel() for m in facts.models for p in m.parameters()),
        synthetic_data=facts.synthetic_data, data_loader_workers=facts.data_loader_workers,
        aggregation_frequency=facts.aggregation_frequency,
        effective_batch_size=gbs * facts.aggregation_frequency,
        gradient_compression=facts.gradient_compression, tensor_fusion_threshold_mb=strategy.fusion_threshold_mb,
        comm_measured=strategy.comm_measured, exchange=strategy.exchange,
        strategy_compressions=sorted(strategy.compressions),
        profiling=timer.enabled, probes=timer.enabled and facts.probes, steps=facts.steps,
        profiled_steps=timer.profiled_steps, timed_steps=timer.timed_steps,
        samples_per_second=samples_per_second,
        samples_per_second_all_steps=all_steps, train_seconds=facts.train_seconds,
        validation_seconds=facts.validation_seconds, checkpoint_seconds=facts.checkpoint_seconds,
        wall_seconds=facts.wall_seconds,
        step_window_seconds=list(timer.windows) if timer.enabled and timer.windows else None,
        unobserved_phases=list(facts.unobserved_phases) or None,
        device_facts=device, resumed_at_batch=facts.resumed_at_batch,
        membership_changes=list(facts.membership_changes) or None,
        first_steps=first_steps_of(timer, gbs / samples_per_second if samples_per_second > 0 else 0.0),
        flops=mfu_section(figures.per_rank, facts.precision, device) if figures is not None and device else None)
