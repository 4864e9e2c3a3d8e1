"""The end-of-run probes may never fail or hang a run that trained: every rank agrees on each probe's outcome.

The probes (:mod:`dtrain.profiling.probes`, :mod:`~dtrain.profiling.modelsteps`, :mod:`~dtrain.profiling.handoff`,
:mod:`~dtrain.profiling.shardprobe`, :mod:`~dtrain.profiling.commprobe`) run after the last checkpoint, on every
rank, some of them with collectives inside and some on the first rank alone while the others wait. One rank's
exception (out of memory at twice the batch) used to send that rank on to the next collective while its peers
waited in the probe's: both hung until the collective timeout and the run lost its profile and report.

:class:`ProbeGuard` runs each probe as a stage: the stage's own work, its exceptions caught on the rank that
raised them, then one small all-reduce on every rank (:meth:`ProbeGuard.agree`) that says whether every rank's
stage succeeded and how much of the probes' time budget every rank has left. A stage that failed on any rank is
skipped on every rank (its figures dropped, the reason recorded), and a probe's collectives are entered only
after an agreement said that every rank is still in. The same agreement is the barrier where the other ranks
wait for a probe the first rank runs alone. What was skipped and why is ``profile.json``'s ``probes_skipped``.

The guards before a probe starts: its time (:func:`time_budget`), the host memory its saved state takes
(:func:`saved_state_bytes` against :func:`host_state_budget`) and, on a GPU, the room twice the batch needs
(:func:`double_batch_refusal`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from dtrain import dist as ddist
from dtrain.profiling.sections import ProbeSkip

T = TypeVar("T")
P = TypeVar("P")

# The probes' share of the run's training time, and the least they get: they exist to price changes of the run,
# so they may add a small fraction of it; a short run (a test, a first try) still gets a few seconds, which the
# tiny trial's whole probe sequence fits in on an idle core.
TIME_SHARE = 0.05
MIN_SECONDS = 10.0
# Share of the host's available memory the probes' saved state (host copies of every model's state and every
# optimizer's, kept on every rank) may take, divided among the host's ranks: the rest stays for the loader
# processes, the page cache of the data and whatever else the host runs; a model too big for it is not probed.
HOST_STATE_SHARE = 0.5
# On a GPU, twice the batch is tried only where its estimated need (twice what the run's batch added above the
# memory held between steps: activations, and gradients, which do not double, counted as if they did) times
# this margin fits in the device's free memory and the allocator's cached blocks: the estimate leaves out the
# allocator's fragmentation, and a probe that runs out of memory costs a CUDA cache flush on that rank.
DOUBLE_BATCH_MARGIN = 1.25
# Reasons are one line in the log and in profile.json: at most this many characters.
REASON_CHARS = 200

log = logging.getLogger(__name__)


def time_budget(train_seconds: float) -> float:
    """Seconds the probes may take: :data:`TIME_SHARE` of the run's training time, at least :data:`MIN_SECONDS`."""
    return max(MIN_SECONDS, TIME_SHARE * max(0.0, train_seconds))


def available_host_bytes() -> float:
    """The host memory available to new allocations (``MemAvailable``: free memory plus what the kernel can
    reclaim), or the free pages where ``/proc/meminfo`` cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def host_state_budget(local_ranks: int, available: float | None = None) -> float:
    """Bytes of saved state one rank may keep: :data:`HOST_STATE_SHARE` of the host's available memory, shared
    by its ``local_ranks`` ranks (each keeps its own copy)."""
    free = available_host_bytes() if available is None else available
    return HOST_STATE_SHARE * free / max(1, local_ranks)


def _tensor_bytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value  # FSDP's DTensor: this rank's shard
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def saved_state_bytes(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> float:
    """Bytes the probes' saved state takes on this rank (:func:`dtrain.profiling.modelsteps.restored`): every
    tensor of the models' state dicts (parameters and buffers) and of the optimizers' state."""
    return float(sum(_tensor_bytes(dict(m.state_dict())) for m in models)
                 + sum(_tensor_bytes(opt.state) for opt in optimizers))


def state_refusal(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                  local_ranks: int) -> str | None:
    """Why the probes' saved state does not fit in this rank's host budget (:func:`host_state_budget`); None
    where it fits."""
    need, budget = saved_state_bytes(models, optimizers), host_state_budget(local_ranks)
    if need <= budget:
        return None
    return (f"its saved state ({need / 2**30:.2f} GiB a rank) is over {HOST_STATE_SHARE:.0%} of the host's available "
            f"memory shared by {max(1, local_ranks)} ranks ({budget / 2**30:.2f} GiB)")


def double_batch_refusal(peak: float, baseline: float, free: float, cached: float) -> str | None:
    """Why twice the batch does not fit on a GPU; None where it does. ``peak``: the run's most allocated bytes;
    ``baseline``: allocated now, between steps (weights, optimizer state); ``free``: the device's free memory;
    ``cached``: the allocator's reserved bytes not allocated (reusable)."""
    need = DOUBLE_BATCH_MARGIN * 2 * max(0.0, peak - baseline)
    room = free + max(0.0, cached)
    if need <= room:
        return None
    return (f"twice the batch needs about {need / 2**30:.2f} GiB beyond the state held between steps (twice the "
            f"run's {max(0.0, peak - baseline) / 2**30:.2f} GiB, with a margin), {room / 2**30:.2f} GiB is free")


def double_batch_room(device: torch.device) -> str | None:
    """:func:`double_batch_refusal` from the CUDA allocator's figures for ``device``; None off a GPU."""
    if device.type != "cuda":
        return None
    allocated = float(torch.cuda.memory_allocated(device))
    free, _total = torch.cuda.mem_get_info(device)
    return double_batch_refusal(float(torch.cuda.max_memory_allocated(device)), allocated, float(free),
                                float(torch.cuda.memory_reserved(device)) - allocated)


def describe(exc: BaseException) -> str:
    """An exception in one line: "out of memory" for the device's or the allocator's, else its type and first line."""
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "out of memory"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:REASON_CHARS] if first else type(exc).__name__


class ProbeGuard:
    """The probes' agreements among the ranks of ``group`` and their time budget (see the module's docstring).
    Every rank makes the same calls in the same order; every decision it returns is the same on every rank."""

    def __init__(self, group: Any, budget_seconds: float, stop_requested: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.group, self.clock, self.stop_requested = group, clock, stop_requested
        self.skipped: list[ProbeSkip] = []
        self._budget = budget_seconds
        self._deadline = clock() + budget_seconds
        self._left = budget_seconds  # as agreed at the last agreement (the least over the ranks)
        self._stopped = False  # a rank was asked to stop, as agreed at the last agreement

    def start(self) -> None:
        """The first agreement, before any probe: every rank takes the least budget over the ranks (each timed
        its own run). A collective: every rank calls it."""
        self.agree("probes", None)

    @property
    def left(self) -> float:
        """Seconds of the budget left, as every rank agreed at the last agreement."""
        return self._left

    def skip(self, probe: str, reason: str) -> None:
        """Record ``probe`` as skipped on a decision every rank made alike (no collective)."""
        self.skipped.append(ProbeSkip(probe=probe, reason=reason[:REASON_CHARS]))
        log.info("%s probe skipped: %s", probe, reason)

    def agree(self, probe: str, failure: str | None) -> bool:
        """Whether every rank's ``probe`` succeeded (``failure`` None on this rank), and the budget left, the least
        over the ranks: one small all-reduce (a collective: every rank calls it). Where some rank failed, every
        rank records the probe as skipped with each failing rank's reason (a second, rare collective)."""
        left_ms = int(max(0.0, self._deadline - self.clock()) * 1000)
        ok, going_on, left_ms = self._least(int(failure is None), int(not self.stop_requested()), left_ms)
        # A stop asked of any rank (Ctrl-C, SIGTERM) ends the probes on every rank: the training is done and
        # checkpointed, and the probes may take minutes of a long run (their budget is a share of its time).
        self._stopped = self._stopped or not going_on
        self._left = 0.0 if self._stopped else left_ms / 1000
        if ok:
            return True
        reasons = self._gather(failure)
        self.skip(probe, "; ".join(f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None))
        return False

    def run(self, probe: str, work: Callable[[], T], default: T, needs: float = 0.0, always: bool = False) -> T:
        """``work()`` on this rank, then :meth:`agree`: its result where every rank's succeeded, else ``default``.
        Not started on any rank (``default``, recorded) where the budget agreed last is under ``needs`` seconds or
        spent, or a stop was asked for, unless ``always`` (what puts back the run's state after the probes).
        ``work`` must not leave a collective its peers would not enter (a rank-local exception before or after
        the stage's own collectives is what this catches)."""
        if not always and not self.has_time(probe, needs):
            return default
        failure: str | None = None
        result = default
        try:
            result = work()
        except Exception as exc:  # this rank's alone: the agreement tells the others
            failure = describe(exc)
            log.info("%s probe failed on this rank: %s", probe, failure, exc_info=True)
        return result if self.agree(probe, failure) else default

    def run_collective(self, probe: str, prepare: Callable[[], P], collective: Callable[[P], T], default: T,
                       needs: float = 0.0) -> T:
        """A probe with collectives of its own: ``prepare()`` (this rank's part before them) as :meth:`run`, then
        ``collective(prepared)`` on every rank only where every rank prepared, then :meth:`agree` again. A rank
        that fails before the collectives keeps every rank out of them; ``collective`` itself must never leave a
        collective its peers enter (its rank-local failures caught where they happen, as the crowded loader probe
        keeps stepping): what it raises after its last collective is agreed on here."""
        prepared = self.run(probe, lambda: (prepare(),), None, needs)
        if prepared is None:
            return default
        failure: str | None = None
        result = default
        try:
            result = collective(prepared[0])
        except Exception as exc:
            failure = describe(exc)
            log.info("%s probe failed on this rank: %s", probe, failure, exc_info=True)
        return result if self.agree(probe, failure) else default

    def has_time(self, probe: str, needs: float = 0.0) -> bool:
        """Whether ``probe`` may start: the agreed budget left is over ``needs`` (and above zero); recorded as
        skipped where not. The same on every rank (no collective)."""
        if self._left > 0 and self._left >= needs:
            return True
        if self._stopped:
            self.skip(probe, "the run was asked to stop (Ctrl-C or SIGTERM) after it had trained")
        else:
            self.skip(probe, f"the probes' time budget ({self._budget:.1f} s) was spent" if self._left <= 0 else
                      f"{self._left:.1f} s of the probes' time budget left, it takes about {needs:.1f} s")
        return False

    def _least(self, *values: int) -> tuple[int, ...]:
        if not ddist.is_distributed(self.group):
            return values
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else None
        found = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(found, op=dist.ReduceOp.MIN, group=self.group)
        return tuple(int(v) for v in found.tolist())

    def _gather(self, failure: str | None) -> list[str | None]:
        if not ddist.is_distributed(self.group):
            return [failure]
        reasons: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(reasons, failure, group=self.group)
        return reasons
