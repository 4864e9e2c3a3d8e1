"""LR schedulers the Trial's loop steps for the user, in Determined's vocabulary.

``context.wrap_lr_scheduler(scheduler, step_mode, frequency=1)`` registers a scheduler (its state travels in
every checkpoint) and says when ``scheduler.step()`` is called, as Determined's
``det.pytorch.LRScheduler.StepMode`` does. The Trial's loop steps it right after ``train_batch``, only on a
batch that steps the optimizer (the last of an aggregation group), and before that batch's checkpoint: a
checkpoint holds the scheduler as the batch left it, so a resume neither repeats nor loses a step.

* ``STEP_EVERY_BATCH`` (a Trial's default): once per ``frequency`` batches trained (with
  ``aggregation_frequency`` k, the steps of a group's k batches are taken together at its optimizer step);
* ``STEP_EVERY_OPTIMIZER_STEP``: once per ``frequency`` optimizer steps. Determined counts batches there
  (``(batch_idx + 1) % frequency``); the two agree unless both k and ``frequency`` exceed 1;
* ``STEP_EVERY_EPOCH``: once per ``frequency`` epochs, at the optimizer step after which the next one falls
  in the next epoch (with k = 1: the epoch's last batch);
* ``MANUAL_STEP``: never; the trial calls ``scheduler.step()`` itself (the only mode of :func:`dtrain.init`'s
  own loop, and its default).

An optimizer step skipped for non-finite gradients (``on_nonfinite: skip``, or a ``16-mixed`` overflow) still
steps the scheduler, as Determined does: the schedule follows batches trained, not updates applied.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

import torch

from dtrain.errors import UserError

log = logging.getLogger(__name__)


class StepMode(enum.Enum):
    """When the loop calls ``scheduler.step()`` (the names and values of Determined's
    ``LRScheduler.StepMode``)."""

    STEP_EVERY_EPOCH = 1
    STEP_EVERY_BATCH = 2
    MANUAL_STEP = 3
    STEP_EVERY_OPTIMIZER_STEP = 4


class LRScheduler:
    """A scheduler with the mode and frequency the loop steps it at; ``LRScheduler.StepMode`` is
    :class:`StepMode`, as ``det.pytorch.LRScheduler.StepMode`` is in Determined."""

    StepMode = StepMode

    def __init__(self, scheduler: Any, step_mode: StepMode, frequency: int = 1) -> None:
        self.scheduler = scheduler
        self.step_mode = step_mode
        self.frequency = frequency

    def step(self) -> None:
        self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


_NAMES = ", ".join(repr(m.name.lower()) for m in StepMode)


def parse_step_mode(step_mode: Any, default: StepMode) -> StepMode:
    """``step_mode`` as a :class:`StepMode`: a member (Determined's own enum too, by name), its name in any
    case (``"step_every_batch"``), or None for ``default``; anything else is a one-line :class:`UserError`."""
    if step_mode is None:
        return default
    if isinstance(step_mode, StepMode):
        return step_mode
    # Determined's own LRScheduler.StepMode (a user porting a trial with det installed): the same names.
    name = step_mode.name if isinstance(step_mode, enum.Enum) else step_mode
    if isinstance(name, str) and name.upper() in StepMode.__members__:
        return StepMode[name.upper()]
    raise UserError(f"wrap_lr_scheduler: step_mode must be one of {_NAMES} (or dtrain.engine.schedulers.StepMode), "
                    f"got {step_mode!r}")


def wrap(scheduler: Any, step_mode: Any, frequency: Any, default: StepMode, has_loop: bool) -> LRScheduler:
    """Check what ``wrap_lr_scheduler`` was given; ``has_loop``: whether a loop of dtrain's will step it."""
    mode = parse_step_mode(step_mode, default)
    if not callable(getattr(scheduler, "step", None)) or not callable(getattr(scheduler, "state_dict", None)):
        raise UserError(f"wrap_lr_scheduler: expected a torch LR scheduler (with step() and state_dict()), got "
                        f"{type(scheduler).__name__}")
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
        raise UserError(f"wrap_lr_scheduler: frequency must be an integer >= 1, got {frequency!r}")
    if mode is not StepMode.MANUAL_STEP:
        if not has_loop:
            raise UserError(f"wrap_lr_scheduler: step_mode {mode.name.lower()!r} needs dtrain's Trial loop; in your "
                            "own loop use step_mode='manual_step' (the default there) and call scheduler.step()")
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise UserError("wrap_lr_scheduler: ReduceLROnPlateau steps on a metric: wrap it with "
                            "step_mode='manual_step' and call scheduler.step(metric) yourself (e.g. in a callback's "
                            "on_validation_end)")
    return LRScheduler(scheduler, mode, frequency)


class _Stepped:
    """One automatically stepped scheduler and the ``last_epoch`` its own steps left it at (to notice a
    trial that steps it too)."""

    __slots__ = ("expected", "warned", "wrapped")

    def __init__(self, wrapped: LRScheduler) -> None:
        self.wrapped = wrapped
        self.expected = getattr(wrapped.scheduler, "last_epoch", None)
        self.warned = False


def stepper(wrapped: list[LRScheduler], batches_per_epoch: int, aggregation: int,
            is_chief: bool) -> Callable[[int, bool], None] | None:
    """What the loop calls after each batch with (batches trained, optimizer stepped?), or None when no
    scheduler is stepped automatically. Built when the loop starts: after a resume has restored the
    schedulers, whose ``last_epoch`` is where their own steps begin."""
    auto = [_Stepped(w) for w in wrapped if w.step_mode is not StepMode.MANUAL_STEP]
    if not auto:
        return None
    k, epoch = aggregation, batches_per_epoch

    def steps_due(w: LRScheduler, b: int) -> int:
        f = w.frequency
        if w.step_mode is StepMode.STEP_EVERY_BATCH:
            first = (b - 1) // k * k + 1  # the group's first batch (the run's last group may be shorter)
            return b // f - (first - 1) // f
        if w.step_mode is StepMode.STEP_EVERY_OPTIMIZER_STEP:
            return 1 if ((b + k - 1) // k) % f == 0 else 0
        # Every epoch e whose end lies between this optimizer step and the next (Determined's rule), one in f:
        # e in [this batch's epoch, the next step's epoch) with (e + 1) % f == 0.
        return (b - 1 + k) // epoch // f - (b - 1) // epoch // f

    def step_schedulers(b: int, stepped_optimizer: bool) -> None:
        if not stepped_optimizer:  # mid-group: no update yet, and no scheduler step (Determined's rule)
            return
        for s in auto:
            n = steps_due(s.wrapped, b)
            if not n:
                continue
            scheduler = s.wrapped.scheduler
            if s.expected is not None and scheduler.last_epoch != s.expected and not s.warned:
                s.warned = True
                if is_chief:
                    log.warning("%s is stepped by dtrain (step_mode %s) and by the trial too, so it runs ahead of "
                                "its schedule: remove the trial's scheduler.step() or wrap it with "
                                "step_mode='manual_step'", type(scheduler).__name__,
                                s.wrapped.step_mode.name.lower())
            for _ in range(n):
                scheduler.step()
            s.expected = getattr(scheduler, "last_epoch", None)

    return step_schedulers
