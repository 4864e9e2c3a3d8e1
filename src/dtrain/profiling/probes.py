"""End-of-run probes: how a slot's work and its batch loading grow with the batch.

The doctor's one-slot estimate (and ``dtrain plan``) must say what one slot would take for N times the
per-slot batch. Work is not proportional to the batch: a small model's step is mostly per-step overhead
(Python, kernel launches, allocator) that a bigger batch does not grow. So after training, on every
rank at the same point, the trial's
own ``train_batch`` runs on the run's per-slot batch and on twice it, without exchanging gradients or
stepping the optimizer; then every optimizer steps on the gradients left (an optimizer streams memory: its
own thread scaling and contention), and one batch of each size is loaded in this thread. The ratios, 1 (all
overhead) to 2 (all per-sample), extrapolate linearly to other batch sizes.

Each size runs once untimed (new shapes: autograd and allocator warm-up), then ``repeats`` times
alternating; the minimum counts (the least disturbed by other processes on a shared machine). Then the
first rank alone, the others waiting at an agreement, repeats it at other thread counts (CPU), prices gradient
compression, and times the model's whole training steps under each precision
(:mod:`dtrain.profiling.modelsteps`). On a CPU host every rank then trains on with 1, 2, ... loader processes
per slot, the cores shared as a run with them would share them (:func:`dtrain.profiling.handoff.crowded_steps`).
Models, optimizer state and random generators are restored after all of it, gradients cleared: the run ends
as it would have without the probes.

Each probe is a stage of a :class:`dtrain.profiling.probeguard.ProbeGuard`: its exceptions (a trial that cannot
take another batch size, out of memory) are caught on the rank that raised them, and every rank agrees after it,
so that one rank's failure skips that probe (zeros) on every rank and no rank is left in a collective its peers
skipped; the probes stop where their time budget is spent, the saved state must fit its host memory budget, and
on a GPU twice the batch is tried only where the run's peak leaves room (``profile.json``'s ``probes_skipped``
says what was skipped and why). Forward and backward run without DDP's buffer broadcast (every rank-local stage
then holds no collective). A parameter server's workers probe among themselves
(its ``dp_group``), the servers waiting: their forward and backward are local, and what the probes time is
what a change of batch or precision moves beside the exchange the cost model holds as measured.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from dtrain import dist as ddist
from dtrain.profiling import modelsteps
from dtrain.profiling.device import cpu_cores
from dtrain.profiling.handoff import (
    CROWDED_BUDGET_SECONDS,
    MAX_LOAD_SECONDS,
    MAX_WORKERS,
    Pace,
    crowded_steps,
    handoff_figures,
    on_host,
)
from dtrain.profiling.modelsteps import restored, time_model_steps
from dtrain.profiling.probeguard import ProbeGuard, describe, double_batch_room, state_refusal
from dtrain.profiling.record import SHARDED, ModelSteps
from dtrain.profiling.runfacts import ProbeHooks, RunFacts
from dtrain.profiling.shardprobe import FIELDS as SHARDED_FIELDS
from dtrain.profiling.shardprobe import fits_unsharded, sharded_exchange, sharded_units

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


def _solo(facts: RunFacts, hooks: ProbeHooks, batches: dict[int, object], repeats: int,
          out: dict[str, float]) -> None:
    """On the first rank only, while the others wait: the work at each of :func:`thread_counts`, so the
    cost model knows what one slot does alone with the cores (another slot count changes both) and how
    much the run's slots slowed each other down (the same probe on every rank at once, beside it). Fills ``out``
    as it goes: where a thread count fails (a trial that cannot take other threads), what was measured stays."""
    # Threads only shape CPU compute; and a sharded model's forward gathers from the other ranks (the others
    # wait at the guard's agreement: it would hang). DDP's buffer broadcast is off here (no_buffer_broadcast).
    if facts.device.type != "cpu" or facts.strategy.forward_needs_every_rank:
        return
    before = torch.get_num_threads()
    try:
        for i, threads in enumerate(thread_counts(facts.threads_per_slot, cpu_cores())):
            torch.set_num_threads(threads)
            work = _time_work(hooks, batches, facts.device, repeats)
            out.update({f"probe_solo{i}_threads": float(threads), f"probe_solo{i}_work": work[1],
                        f"probe_solo{i}_double": work.get(2, 0.0),
                        f"probe_solo{i}_optimizer": _time_optimizer(facts.optimizers, facts.device, repeats)})
        out.update(compression_cost(facts.models, facts.powersgd_rank))
    finally:
        torch.set_num_threads(before)


def _model_steps(facts: RunFacts, hooks: ProbeHooks, batches: dict[int, object], budget: float,
                 double_skipped: str | None) -> ModelSteps | None:
    """The first rank alone: the model's own steps under each precision (:mod:`dtrain.profiling.modelsteps`)
    within ``budget`` seconds; None where one rank cannot run the model alone (a sharded forward)."""
    if facts.strategy.forward_needs_every_rank:
        return None
    # At the thread counts the solo probe times too: what another slot count gives a slot.
    others = thread_counts(facts.threads_per_slot, cpu_cores())[1:] if facts.device.type == "cpu" else []
    return time_model_steps(hooks, facts.models, facts.optimizers, facts.device, batches[1], batches.get(2),
                            facts.per_slot_batch_size, keep_state=False,  # batch_probe restores it
                            other_threads=others, budget=min(modelsteps.BUDGET_SECONDS, budget),
                            double_skipped=double_skipped)


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


def batch_probe(facts: RunFacts, guard: ProbeGuard, repeats: int | None = None) -> ProbeResult:
    """Per-rank probe figures (``PROBE_FIELDS``, seconds; zeros when not probed). Collective-safe: every
    rank runs the same calls, each probe a stage of ``guard`` (:mod:`dtrain.profiling.probeguard`): one rank's
    failure skips that probe on every rank, and the probes stop where their time budget is spent."""
    zeros = dict.fromkeys(PROBE_FIELDS, 0.0)
    hooks = facts.probe
    if hooks is None or not facts.models:
        return ProbeResult(zeros)
    timer = facts.timer
    if repeats is None:
        last = timer.last_step_seconds
        repeats = int(max(MIN_REPEATS, min(MAX_REPEATS, BUDGET_SECONDS / (3 * last)))) if last > 0 else MIN_REPEATS
        # A trial that calls opt.step() itself would step its optimizer here: no probe (0 on any rank: none).
        own_step = "optimizer" in facts.unobserved_phases
        repeats = ddist.least_over_ranks(0 if own_step else repeats, facts.strategy.dp_group)
    if repeats < 1:
        guard.skip("batch_probe", "the trial steps its optimizer itself (on some rank), which the probe would step")
        return ProbeResult(zeros)
    # The work probe runs without gradient sync: a sharded model's gradients stay whole on every rank (and the
    # double batch's activations beside them). A model sharded because it does not fit whole is not probed.
    if facts.strategy.exchange == SHARDED and not fits_unsharded(facts.models, facts.optimizers, facts.device,
                                                                  facts.strategy.dp_group, facts.local_ranks):
        guard.skip("batch_probe", "the sharded model's whole gradients would not fit beside it")
        return ProbeResult(zeros)
    # The probes' forwards move norm statistics and draw random numbers, the model-step probe updates the weights:
    # all is put back (gradients cleared), so the run ends as it would have without them. The copies are kept in
    # host memory on every rank: within its budget, or no probe.
    if not guard.has_time("batch_probe") or not guard.agree("batch_probe", _checked(
            lambda: state_refusal(facts.models, facts.optimizers, facts.local_ranks))):
        return ProbeResult(zeros)
    saved = contextlib.ExitStack()

    def save() -> bool:
        saved.enter_context(restored(facts.models, facts.optimizers, facts.device))
        return True

    try:
        out, steps = _probes(facts, hooks, guard, repeats) if guard.run("batch_probe", save, False) else ({}, None)
    except BaseException:  # not a probe's failure (a stage catches those): this rank's state put back, and on
        with contextlib.suppress(Exception):
            saved.close()
        raise
    finally:
        timer.exchanging = True
    # The state put back on every rank (or said where not), whatever the budget left or a stop asked for: the
    # probes changed the weights, and the run must end as it would have without them.
    guard.run("restore", saved.close, None, always=True)
    return ProbeResult({**zeros, **out}, steps)


def _probes(facts: RunFacts, hooks: ProbeHooks, guard: ProbeGuard,
            repeats: int) -> tuple[dict[str, float], ModelSteps | None]:
    """The probes after the state was saved (:func:`batch_probe`), each a stage of ``guard``."""
    per_slot, device = facts.per_slot_batch_size, facts.device
    # On a GPU, twice the batch only where the run's own peak leaves room for it (every rank alike).
    double_skipped = None
    if not guard.agree("double_batch", _checked(lambda: double_batch_room(device))):
        double_skipped = guard.skipped[-1].reason

    def prepare() -> tuple[object, dict[int, object]]:
        _, _, one = _load(hooks.loader, per_slot)
        batches = {1: hooks.to_device(one)}
        if double_skipped is None:
            batches[2] = hooks.to_device(_double(one))
        return one, batches

    prepared = guard.run("batch_probe", prepare, None)
    if prepared is None:
        return {}, None
    one, batches = prepared
    loads: dict[str, float] = {}
    if not facts.synthetic_data:
        loads = guard.run("data_loading", lambda: _load_and_handoff(hooks.loader, per_slot, one), {})
    first = facts.strategy.dp_rank == 0
    solo: dict[str, float] = {}
    # Forward and backward only: no exchange, no optimizer step, no buffer broadcast (every stage rank-local).
    with hooks.gradient_sync(False), no_buffer_broadcast(facts.models):
        timed = guard.run("batch_scaling", lambda: (_time_work(hooks, batches, device, repeats),
                                                    _time_optimizer(facts.optimizers, device, repeats)), None)
        # The first rank alone: the others wait at the stage's agreement.
        guard.run("solo_probe", lambda: _solo(facts, hooks, batches, repeats, solo) if first else None, None)
        steps = guard.run("model_steps", lambda: _model_steps(facts, hooks, batches, guard.left, double_skipped)
                          if first else None, None)
    work: dict[str, float] = {}
    if timed is not None:
        sizes, optimizer = timed
        work = {"probe_work": sizes[1], "probe_work_double": sizes.get(2, 0.0), "probe_optimizer": optimizer}
    if not facts.synthetic_data and device.type == "cpu" and facts.strategy.name in STEPS_ALONE:
        # Every rank trains on (its collectives entered by all, since every rank agreed to start).
        loads.update(guard.run_collective("data_crowded", lambda: _crowd_pace(facts, loads),
                                          lambda pace: _crowded_figures(facts, hooks, batches[1], pace), {},
                                          needs=CROWDED_BUDGET_SECONDS))
    sharded: dict[str, float] = {}
    if facts.strategy.exchange == SHARDED:  # its collectives run inside forward and backward: with and without
        sharded = guard.run_collective("sharded_exchange", lambda: sharded_units(
            facts.models, facts.optimizers, device, facts.local_ranks), lambda units: sharded_exchange(
            units, lambda: hooks.train_batch(batches[1], 0, 0), device, facts.strategy.dp_group, repeats), {})
    return {**work, **solo, **sharded, **loads}, steps


def _checked(check: Callable[[], str | None]) -> str | None:
    """``check()``'s refusal, or the exception it raised in one line."""
    try:
        return check()
    except Exception as exc:
        return describe(exc)


def _load_and_handoff(loader: DataLoader[object], per_slot: int, one: object) -> dict[str, float]:
    loads = _load_figures(loader, per_slot)
    if on_host(one) and loads["probe_load"] <= MAX_LOAD_SECONDS:
        loads.update(handoff_figures(loader, per_slot))
    return loads


@contextlib.contextmanager
def no_buffer_broadcast(models: Sequence[nn.Module]) -> Iterator[None]:
    """DDP broadcasts the first rank's buffers at the first forward after an exchanging step, under ``no_sync``
    too: a collective inside the probes' first forward, which a rank whose probe failed before it would leave
    its peers in. Off within (each rank's forwards use its own buffers, restored after), put back after."""
    wrapped = [m for model in models for m in model.modules() if isinstance(m, DistributedDataParallel)]
    before = [m.require_forward_param_sync for m in wrapped]
    for m in wrapped:
        m.require_forward_param_sync = False
    try:
        yield
    finally:
        for m, value in zip(wrapped, before, strict=True):
            m.require_forward_param_sync = value


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


def _crowd_pace(facts: RunFacts, loads: dict[str, float]) -> Pace:
    """What sizes the crowded loader probe (rank-local, before its collectives): the run's step without its data
    wait, and this rank's loading figures."""
    phases = facts.timer.per_step()
    rest = max(0.0, phases["step"] - phases["data"])
    return Pace(rest, loads.get("probe_load", 0.0), loads.get("probe_handoff", 0.0))


def _crowded_figures(facts: RunFacts, hooks: ProbeHooks, batch: object, pace: Pace) -> dict[str, float]:
    """``probe_crowd{W}``: the step with W loader processes per slot (0: none, where the run had some), timed beside
    the training's own work
    (:func:`dtrain.profiling.handoff.crowded_steps`): the trial's own training steps, exchange and optimizer step
    included, as the run aggregated them (the weights are put back after); ``probe_crowd_own``: the step timed
    the same way with the run's own loader processes. One slot or DDP only: a strategy
    with server ranks, sharded state or periodic averaging cannot step here as it trained (its loader advice
    keeps the formula's pricing)."""
    every, taken_steps = facts.aggregation_frequency, itertools.count(1)
    facts.timer.recorder.hold_native()  # these steps exchange too: not the run's

    def step(taken: object | None) -> bool:
        """A training step on the batch ``taken`` through the loader processes; where there is none (this rank's
        loader failed) or it fails before its exchange, on the probe's own batch, which every rank trained on in
        the work probe: a rank still trains, its peers' exchange waits for it. False where ``taken`` failed."""
        with hooks.gradient_sync(next(taken_steps) % every == 0):
            if taken is not None:
                try:
                    hooks.train_batch(hooks.to_device(taken), 0, 0)
                    return True
                except Exception as exc:
                    log.info("crowded loader probe: a loaded batch failed on this rank: %s", describe(exc))
            hooks.train_batch(batch, 0, 0)
            return False

    try:
        timed = crowded_steps(hooks.loader, facts.per_slot_batch_size, pace, facts.data_loader_workers,
                              facts.strategy.dp_group, step)
    finally:
        hooks.gradient_sync(True)  # as the run left it
    if timed is None:  # (the same on every rank: crowded_steps agrees on each count)
        raise RuntimeError("not even the run's own loader setting could be timed within the probe's budget")
    return {"probe_crowd_own": timed.own, **{f"probe_crowd{w}": seconds for w, seconds in timed.steps.items()}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
