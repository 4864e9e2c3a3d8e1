"""Clocks for the step profiler: when is "now", as seen by the device doing the work?

On CPU the work is done when the Python call returns, so ``time.perf_counter`` is exact and stamps are
resolved at once. On CUDA, kernels run asynchronously: a host clock read after a launch says when the
*launch* happened, not when the work ended, and synchronizing at every phase edge (the usual fix) stalls
the pipeline the profiler is meant to observe. So on CUDA a stamp is a CUDA event recorded on the current
stream; events are read back in batches (:meth:`CudaClock.resolve` after one synchronization per window),
and the events are reused from a pool so that steady-state steps allocate nothing.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class Clock(Protocol):
    """What the step timer and the communication recorder read time from: stamps (a float on the host, a
    CUDA event on GPU), their difference in seconds once resolved, and whether resolving needs a
    synchronization first (``deferred``)."""

    deferred: bool

    def stamp(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...

    def synchronize(self) -> None: ...

    def recycle(self) -> None: ...


class HostClock:
    """``time.perf_counter``: exact for work that is done when the call returns (CPU)."""

    deferred = False
    # The builtin itself, not a method around it: the step timer calls this at every phase edge.
    stamp = staticmethod(time.perf_counter)

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)

    def synchronize(self) -> None:
        """Nothing is in flight on the host."""

    def recycle(self) -> None:
        """Host stamps are plain floats: nothing to give back."""


class CudaClock:
    """CUDA events recorded on the current stream, from a pool reused window after window."""

    deferred = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: list[torch.cuda.Event] = []
        self._used = 0

    def stamp(self) -> torch.cuda.Event:
        if self._used == len(self._pool):  # grows during the first window only
            self._pool.append(torch.cuda.Event(enable_timing=True))
        event = self._pool[self._used]
        self._used += 1
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        # elapsed_time needs both events complete: callers synchronize once per window first.
        return start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def recycle(self) -> None:
        """Every stamp of the window has been resolved: the events may be recorded again."""
        self._used = 0


def clock_for(device: torch.device) -> HostClock | CudaClock:
    return CudaClock(device) if device.type == "cuda" else HostClock()


def synchronized_now(device: torch.device) -> float:
    """A host time at which every kernel queued so far on ``device`` has finished (one sync on CUDA).

    Throughput figures are intervals between such points (report boundaries, the run's start and end),
    so they stay true whatever runs asynchronously in between.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
