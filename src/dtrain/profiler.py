"""Per-step time breakdown: where does a training step's time go?

Phase edges are marked by the trainer (data wait) and by the context (``backward``, ``step_optimizer``),
so a trial needs no timing code. On CPU a monotonic clock is exact; on CUDA kernels run asynchronously,
so the device is synchronized at phase edges (only there) to charge each kernel to its phase.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

PHASES = ("data", "forward", "backward", "optimizer", "other")


class StepTimer:
    """Accumulates seconds per phase over the steps of a run (per rank)."""

    def __init__(self, device: torch.device) -> None:
        self._sync = device.type == "cuda"
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.step_seconds = 0.0
        self._step_start = 0.0
        self._mark = 0.0

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start_step(self) -> None:
        self._step_start = self._mark = self._now()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous edge to ``phase``."""
        now = self._now()
        self.totals[phase] += now - self._mark
        self._mark = now

    @contextmanager
    def phase(self, name: str, before: str = "forward") -> Iterator[None]:
        """Time a block as ``name``; the gap since the last edge goes to ``before``."""
        self.lap(before)
        try:
            yield
        finally:
            self.lap(name)

    def end_step(self) -> None:
        self.lap("other")
        self.steps += 1
        self.step_seconds += self._mark - self._step_start

    def per_step(self) -> dict[str, float]:
        """Mean seconds per step for each phase, and for the whole step."""
        n = max(1, self.steps)
        out = {p: s / n for p, s in self.totals.items()}
        out["step"] = self.step_seconds / n
        return out

    def state_dict(self) -> dict[str, float | int | dict[str, float]]:
        return {"totals": dict(self.totals), "steps": self.steps, "step_seconds": self.step_seconds}
