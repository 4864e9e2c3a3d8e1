"""The first steps of a run, apart from its steady state: how long until the first step, and what the
first steps cost beyond as many steady ones.

A run's first steps are slower than the rest: the caching allocator asks the device for memory
(``cudaMalloc``) until its pools hold a step's tensors, libraries pick or time their kernels (cuDNN's
benchmark mode times every convolution algorithm on each new shape; cuBLAS loads its kernels), Python and
autograd warm their caches. The profiler leaves them out of its statistics (``profiling.warmup_steps``);
this module times them instead, with a device synchronization at each of their ends (warm-up steps only:
the steady steps keep the profiler's no-sync timing), and counts the allocator's new segments during them
and after them.

:class:`FirstStepsTimer` is the step timer with those stamps; after its first steps it hands the timer's
own methods back to the instance, so a steady step runs no code of this module.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtrain.profiling.clock import synchronized_now
from dtrain.profiling.record import FirstSteps
from dtrain.profiling.timer import StepTimer


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux's /proc), None where that cannot be read."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(after_name[19])  # field 22 of stat(5); the fields after "pid (comm)" start at 3
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def allocator_segments(device: torch.device) -> int | None:
    """Memory segments the CUDA caching allocator has asked the device for so far (None off CUDA)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("segment.all.allocated", 0))


def autotuning_in_use(device: torch.device) -> list[str]:
    """Library autotuning known to run in the first steps on ``device`` (empty: none known)."""
    if device.type == "cuda" and torch.backends.cudnn.enabled and torch.backends.cudnn.benchmark:
        return ["cudnn.benchmark: each convolution's algorithms timed on every new input shape"]
    return []


@dataclass
class FirstStepStamps:
    """Device-synchronized host times of the first ``limit`` steps: when the first began, when each ended."""

    device: torch.device
    limit: int
    begin: float | None = None
    startup_seconds: float | None = None  # this process's start to the first step's start
    segments_at_begin: int | None = None
    segments_after: int | None = None

    def __post_init__(self) -> None:
        self.ends: list[float] = []

    @property
    def done(self) -> bool:
        return len(self.ends) >= self.limit

    def step_starts(self) -> None:
        if self.begin is None:
            self.begin = synchronized_now(self.device)
            age = process_age_seconds()
            self.startup_seconds = age if age is None else max(0.0, age - (time.perf_counter() - self.begin))
            self.segments_at_begin = allocator_segments(self.device)

    def step_ends(self) -> None:
        self.ends.append(synchronized_now(self.device))
        if self.done:
            self.segments_after = allocator_segments(self.device)

    def section(self, steady_step_seconds: float) -> dict[str, Any] | None:
        """``first_steps`` of summary.json and profile.json (None before any step ended)."""
        if self.begin is None or not self.ends:
            return None
        steps = len(self.ends)
        seconds = self.ends[-1] - self.begin
        first = self.ends[0] - self.begin
        end_segments = allocator_segments(self.device)
        during = later = None
        if self.segments_after is not None and self.segments_at_begin is not None and end_segments is not None:
            during, later = self.segments_after - self.segments_at_begin, end_segments - self.segments_after
        return {"startup_seconds": self.startup_seconds, "first_step_seconds": first,
                "time_to_first_step_seconds": None if self.startup_seconds is None else self.startup_seconds + first,
                "steps": steps,
                "seconds": seconds, "steady_step_seconds": steady_step_seconds,
                "excess_seconds": max(0.0, seconds - steps * steady_step_seconds) if steady_step_seconds > 0 else 0.0,
                "allocator_segments": during, "allocator_segments_later": later,
                "autotuning": autotuning_in_use(self.device)}


class FirstStepsTimer(StepTimer):
    """:class:`StepTimer` that also stamps its first steps (the warm-up steps, at least one) synchronized."""

    def __init__(self, device: torch.device, enabled: bool = True, warmup_steps: int = 3, clock: Any = None,
                 sample_every: int = 1) -> None:
        super().__init__(device, enabled=enabled, warmup_steps=warmup_steps, clock=clock, sample_every=sample_every)
        self.first_steps = FirstStepStamps(device, max(1, warmup_steps))

    def start_step(self) -> None:
        self.first_steps.step_starts()
        super().start_step()

    def end_step(self) -> None:
        super().end_step()
        self.first_steps.step_ends()
        if self.first_steps.done:
            # The timer's own methods on the instance from here on: the trainer's calls reach them directly.
            self.start_step = super().start_step  # type: ignore[method-assign]
            self.end_step = super().end_step  # type: ignore[method-assign]


def first_steps_of(timer: StepTimer, steady_step_seconds: float) -> FirstSteps | None:
    """``first_steps`` of a run's timer (None: a plain :class:`StepTimer`, or no step ended)."""
    stamps = timer.first_steps if isinstance(timer, FirstStepsTimer) else None
    section = stamps.section(steady_step_seconds) if stamps is not None else None
    return FirstSteps.model_validate(section) if section is not None else None
