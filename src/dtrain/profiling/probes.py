"""End-of-run probes: how a slot's work and its batch loading grow with the batch.

The doctor's one-slot estimate (and ``dtrain plan``) must say what one slot would take for N times the
per-slot batch. Work is not proportional to the batch: a small model's step is mostly per-step overhead
(Python, kernel launches, allocator) that a bigger batch does not grow. So after training, on every
rank at the same point (the probe's forward may hold collectives, as DDP's buffer broadcast), the trial's
own ``train_batch`` runs on the run's per-slot batch and on twice it, without exchanging gradients or
stepping the optimizer; then every optimizer steps on the gradients left (an optimizer streams memory: its
own thread scaling and contention), and one batch of each size is loaded in this thread. The ratios, 1 (all
overhead) to 2 (all per-sample), extrapolate linearly to other batch sizes.

Each size runs once untimed (new shapes: autograd and allocator warm-up), then ``repeats`` times
alternating; the minimum counts (the least disturbed by other processes on a shared machine). Then the
first rank alone, the others waiting at a barrier, repeats it at other thread counts (CPU), prices gradient
compression, and times the model's whole training steps under each precision
(:mod:`dtrain.profiling.modelsteps`). On a CPU host every rank then trains on with 1, 2, ... loader processes
per slot, the cores shared as a run with them would share them (:func:`dtrain.profiling.handoff.crowded_steps`).
Models, optimizer state and random generators are restored after all of it, gradients cleared: the run ends
as it would have without the probes. Skipped (zeros) on any
error (a trial that cannot take another batch size). A parameter server's workers probe among themselves
(its ``dp_group``), the servers waiting: their forward and backward are local, and what the probes time is
what a change of batch or precision moves beside the exchange the cost model holds as measured.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.data import DataLoader

from dtrain import dist as ddist
from dtrain.profiling.device import cpu_cores
from dtrain.profiling.handoff import (
    MAX_LOAD_SECONDS,
    MAX_WORKERS,
    Pace,
    crowded_steps,
    handoff_figures,
    on_host,
)
from dtrain.profiling.modelsteps import restored, time_model_steps
from dtrain.profiling.record import SHARDED, ModelSteps
from dtrain.profiling.runfacts import ProbeHooks, RunFacts
from dtrain.profiling.shardprobe import FIELDS as SHARDED_FIELDS
from dtrain.profiling.shardprobe import fits_unsharded, sharded_exchange

# Thread counts the solo probe tries: the run's own, one, and every core (at most this many).
SOLO_THREADS = 3
# Strategies whose training steps the crowded loader probe can run as the run did.
STEPS_ALONE = ("ddp", "single_device")
CROWDED_FIELDS = ("probe_crowd_own", *(f"probe_crowd{w}" for w in range(MAX_WORKERS + 1)))
SOLO_FIELDS = tuple(f"probe_solo{i}_{what}" for i in range(SOLO_THREADS)
                    for what in ("threads", "work", "double", "optimizer"))
PROBE_FIELDS = ("probe_work", "probe_work_double", "probe_optimizer", "probe_load", "probe_load_double",
                "probe_load_cpu_share", "probe_handoff", "probe_handoff_cpu",
                *SOLO_FIELDS, "probe_fp16_seconds", "probe_powersgd_seconds", "probe_powersgd_bytes",
                "probe_powersgd_rank", *SHARDED_FIELDS, *CROWDED_FIELDS)
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


def _load(loader: DataLoader[object], count: int) -> tuple[float, float, Any]:
    """Seconds and CPU seconds (this thread) to read ``count`` records and collate them; the batch."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    batch = loader.collate_fn(_records(loader.dataset, count))
    return time.perf_counter() - start, time.thread_time() - start_cpu, batch


def _time_work(hooks: ProbeHooks, batches: dict[int, object], device: torch.device, repeats: int) -> dict[int, float]:
    """Least seconds of the trial's ``train_batch`` per batch size (the first round warms each shape up)."""
    work = dict.fromkeys(batches, float("inf"))
    for round_ in range(repeats + 1):
        for size, batch in batches.items():
            _sync(device)
            start = time.perf_counter()
            hooks.train_batch(batch, 0, 0)
            _sync(device)
            if round_:
                work[size] = min(work[size], time.perf_counter() - start)
    return work


def _time_optimizer(optimizers: Sequence[torch.optim.Optimizer], device: torch.device, repeats: int) -> float:
    """Least seconds of one step of every optimizer on the gradients the work left (the first round warms up):
    the run's optimizer phase is memory traffic that threads and other slots on the host change otherwise
    than the model's matmuls. 0 where a step fails (an optimizer that needs a closure)."""
    least = float("inf")
    try:
        for round_ in range(repeats + 1):
            _sync(device)
            start = time.perf_counter()
            for opt in optimizers:
                opt.step()
            _sync(device)
            if round_:
                least = min(least, time.perf_counter() - start)
    except Exception as exc:
        log.info("optimizer probe skipped: %s", exc)
        return 0.0
    return least if optimizers and least < float("inf") else 0.0


def thread_counts(run_threads: int, cores: int) -> list[int]:
    """The run's own thread count first, then one and every core: what other slot counts would get."""
    counts = [run_threads]
    for t in (1, cores):
        if t not in counts:
            counts.append(t)
    return counts[:SOLO_THREADS]


def _solo(facts: RunFacts, hooks: ProbeHooks, batches: dict[int, object], repeats: int) -> dict[str, float]:
    """On the first rank only, while the others wait: the work at each of :func:`thread_counts`, so the
    cost model knows what one slot does alone with the cores (another slot count changes both) and how
    much the run's slots slowed each other down (the same probe on every rank at once, beside it)."""
    out: dict[str, float] = {}
    # Threads only shape CPU compute; and a sharded model's forward gathers from the other ranks (the others
    # wait at a barrier: it would hang). DDP's buffer broadcast is off here: the probe's rounds on every rank
    # ran under no_sync, after which DDP skips it.
    if facts.device.type != "cpu" or facts.strategy.forward_needs_every_rank:
        return out
    before = torch.get_num_threads()
    try:  # never raises: the other ranks wait at a barrier for this one
        for i, threads in enumerate(thread_counts(facts.threads_per_slot, cpu_cores())):
            torch.set_num_threads(threads)
            work = _time_work(hooks, batches, facts.device, repeats)
            out.update({f"probe_solo{i}_threads": float(threads), f"probe_solo{i}_work": work[1],
                        f"probe_solo{i}_double": work[2],
                        f"probe_solo{i}_optimizer": _time_optimizer(facts.optimizers, facts.device, repeats)})
        out.update(compression_cost(facts.models, facts.powersgd_rank))
    except Exception as exc:  # a trial that cannot take other threads: what was measured stays
        log.info("solo probe stopped: %s", exc)
    finally:
        torch.set_num_threads(before)
    return out


def _model_steps(facts: RunFacts, hooks: ProbeHooks, batches: dict[int, object]) -> ModelSteps | None:
    """The first rank alone: the model's own steps under each precision (:mod:`dtrain.profiling.modelsteps`);
    None where one rank cannot run the model alone (a sharded forward) or on an error."""
    if facts.strategy.forward_needs_every_rank:
        return None
    try:  # never raises: the other ranks wait at a barrier for this one
        # At the thread counts the solo probe times too: what another slot count gives a slot.
        others = thread_counts(facts.threads_per_slot, cpu_cores())[1:] if facts.device.type == "cpu" else []
        return time_model_steps(hooks, facts.models, facts.optimizers, facts.device, batches[1], batches[2],
                                facts.per_slot_batch_size, keep_state=False,  # batch_probe restores it
                                other_threads=others)
    except Exception as exc:
        log.info("model-step probe skipped: %s", exc)
        return None


def compression_cost(models: Sequence[nn.Module], rank: int, repeats: int = 3) -> dict[str, float]:
    """Seconds per exchange of compressing the gradients, on this rank's threads, as the hooks do it:
    fp16 (cast down and back into the bucket) and PowerSGD (per matrix: two matmuls, a QR and the
    reconstruction), and the bytes PowerSGD sends. Not free: on a fast link or a small model they can cost
    more than they save."""
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    if not params:
        return {}
    flat = torch.randn(sum(p.numel() for p in params), device=params[0].device)
    fp16 = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        flat.copy_(flat.to(torch.float16).to(torch.float32))  # as the hook: cast, cast back, into the bucket
        _sync(flat.device)
        fp16 = min(fp16, time.perf_counter() - start)
    shapes = [(p.shape[0], p.numel() // p.shape[0]) for p in params if p.dim() >= 2]
    matrices = [(n, m) for n, m in shapes if rank * (n + m) < n * m]
    dense = sum(p.numel() for p in params) - sum(n * m for n, m in matrices)
    tensors = [(torch.randn(n, m, device=flat.device), torch.randn(m, rank, device=flat.device)) for n, m in matrices]
    powersgd = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for grad, q in tensors:
            p_, _ = torch.linalg.qr(grad @ q)
            q_new = grad.T @ p_
            grad - p_ @ q_new.T
        _sync(flat.device)
        powersgd = min(powersgd, time.perf_counter() - start)
    sent = 4.0 * (dense + sum(rank * (n + m) for n, m in matrices))
    return {"probe_fp16_seconds": fp16, "probe_powersgd_seconds": powersgd, "probe_powersgd_bytes": sent,
            "probe_powersgd_rank": float(rank)}


@dataclass(frozen=True)
class ProbeResult:
    """What :func:`batch_probe` measured: this rank's figures (``PROBE_FIELDS``, gathered from every rank)
    and, on the first rank, the model's timed steps."""

    figures: dict[str, float]
    model_steps: ModelSteps | None = None


def batch_probe(facts: RunFacts, repeats: int | None = None) -> ProbeResult:
    """Per-rank probe figures (``PROBE_FIELDS``, seconds; zeros when not probed). Collective-safe: every
    rank runs the same calls."""
    zeros = dict.fromkeys(PROBE_FIELDS, 0.0)
    hooks = facts.probe
    if hooks is None or not facts.models:
        return ProbeResult(zeros)
    per_slot, timer, device = facts.per_slot_batch_size, facts.timer, facts.device
    if repeats is None:
        last = timer.last_step_seconds
        repeats = int(max(MIN_REPEATS, min(MAX_REPEATS, BUDGET_SECONDS / (3 * last)))) if last > 0 else MIN_REPEATS
        # A trial that calls opt.step() itself would step its optimizer here: no probe (0 on any rank: none).
        own_step = "optimizer" in facts.unobserved_phases
        repeats = ddist.least_over_ranks(0 if own_step else repeats, facts.strategy.dp_group)
    if repeats < 1:
        log.info("batch probe skipped: the trial steps its optimizer itself (on some rank), which the probe would "
                 "step")
        return ProbeResult(zeros)
    # The work probe runs without gradient sync: a sharded model's gradients stay whole on every rank (and the
    # double batch's activations beside them). A model sharded because it does not fit whole is not probed.
    if facts.strategy.exchange == SHARDED and not fits_unsharded(facts.models, facts.optimizers, facts.device,
                                                                  facts.strategy.dp_group, facts.local_ranks):
        log.info("batch probe skipped: the sharded model's whole gradients would not fit beside it")
        return ProbeResult(zeros)
    steps: ModelSteps | None = None
    try:
        # The probes' forwards move norm statistics and draw random numbers, the model-step probe updates
        # the weights: all is put back (gradients cleared), so the run ends as it would have without them.
        with restored(facts.models, facts.optimizers, device):
            _, _, one = _load(hooks.loader, per_slot)
            batches = {1: hooks.to_device(one), 2: hooks.to_device(_double(one))}
            loads: dict[str, float] = {}
            if not facts.synthetic_data:
                loads = _load_figures(hooks.loader, per_slot)
                if on_host(one) and loads["probe_load"] <= MAX_LOAD_SECONDS:
                    loads.update(handoff_figures(hooks.loader, per_slot))
            with hooks.gradient_sync(False):  # no exchange, no optimizer step: forward and backward only
                work = _time_work(hooks, batches, device, repeats)
                optimizer = _time_optimizer(facts.optimizers, device, repeats)  # every rank at once, as in the run
                first = facts.strategy.dp_rank == 0
                solo = _solo(facts, hooks, batches, repeats) if first else {}
                steps = _model_steps(facts, hooks, batches) if first else None
                _barrier(facts.strategy.dp_group)  # the others wait, idle, while the first rank probes alone
            if not facts.synthetic_data and device.type == "cpu":  # every rank (a collective)
                loads.update(_crowded_figures(facts, hooks, batches[1], loads))
            # A sharded run's collectives run inside forward and backward: timed with and without them.
            sharded = (sharded_exchange(facts.models, facts.optimizers, lambda: hooks.train_batch(batches[1], 0, 0),
                                        device, facts.strategy.dp_group, repeats, facts.local_ranks)
                       if facts.strategy.exchange == SHARDED else {})
        out = {"probe_work": work[1], "probe_work_double": work[2], "probe_optimizer": optimizer, **solo,
               **sharded, **loads}
        return ProbeResult({**zeros, **out}, steps)
    except Exception as exc:  # a trial that cannot take another batch size: no probe, not a failed run
        log.info("batch probe skipped: %s", exc)
        return ProbeResult(zeros, steps)
    finally:
        timer.exchanging = True


def _load_figures(loader: DataLoader[object], per_slot: int) -> dict[str, float]:
    """Least seconds to load one batch and two, and the share of that on this thread's CPU."""
    loads = {1: float("inf"), 2: float("inf")}
    wall = cpu = 0.0
    for _ in range(MAX_REPEATS):  # rank-local: as many rounds as fit in the budget
        for size in (1, 2):
            seconds, cpu_seconds, _ = _load(loader, size * per_slot)
            loads[size] = min(loads[size], seconds)
            wall, cpu = wall + seconds, cpu + cpu_seconds
        if wall > BUDGET_SECONDS:
            break
    return {"probe_load": loads[1], "probe_load_double": loads[2],
            "probe_load_cpu_share": min(1.0, cpu / wall) if wall > 0 else 1.0}


def _crowded_figures(facts: RunFacts, hooks: ProbeHooks, batch: object, loads: dict[str, float]) -> dict[str, float]:
    """``probe_crowd{W}``: the step with W loader processes per slot (0: none, where the run had some), timed beside
    the training's own work
    (:func:`dtrain.profiling.handoff.crowded_steps`): the trial's own training steps, exchange and optimizer step
    included, as the run aggregated them (the weights are put back after); ``probe_crowd_own``: the step timed
    the same way with the run's own loader processes. One slot or DDP only: a strategy
    with server ranks, sharded state or periodic averaging cannot step here as it trained (its loader advice
    keeps the formula's pricing)."""
    if facts.strategy.name not in STEPS_ALONE:
        return {}
    phases = facts.timer.per_step()
    rest = max(0.0, phases["step"] - phases["data"])
    every, taken_steps = facts.aggregation_frequency, itertools.count(1)
    facts.timer.recorder.hold_native()  # these steps exchange too: not the run's

    def step(taken: object | None) -> None:  # a rank whose loader failed still trains: its peers' exchange waits
        with hooks.gradient_sync(next(taken_steps) % every == 0):
            hooks.train_batch(hooks.to_device(taken) if taken is not None else batch, 0, 0)

    try:
        pace = Pace(rest, loads.get("probe_load", 0.0), loads.get("probe_handoff", 0.0))
        timed = crowded_steps(hooks.loader, facts.per_slot_batch_size, pace, facts.data_loader_workers,
                              facts.strategy.dp_group, step)
    finally:
        hooks.gradient_sync(True)  # as the run left it
    if timed is None:
        return {}
    return {"probe_crowd_own": timed.own, **{f"probe_crowd{w}": seconds for w, seconds in timed.steps.items()}}


def _barrier(group: ProcessGroup | None) -> None:
    import torch.distributed as dist

    if ddist.is_distributed(group):
        dist.barrier(group=group)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
