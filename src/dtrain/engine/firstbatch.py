"""What the Trial's loop checks once, after the first batch it trains: what a first-time user gets wrong
silently.

* ``train_batch`` written the torchrun way (``loss.backward(); opt.step()``) trains, but around dtrain:
  aggregation, loss scaling, ``on_nonfinite`` and the profile's phases need ``context.backward`` and
  ``context.step_optimizer``. The phases not seen are recorded (``profile.json``'s ``unobserved_phases``),
  and the doctor does not diagnose them.
* a hyperparameter set but never read (``learning_rate`` where the trial reads ``lr``) changes nothing:
  named at the end of the run, once every rank's reads are known.

Each is one warning line from the chief; nothing here runs per step.
"""

from __future__ import annotations

import logging

import torch.distributed as tdist

from dtrain import dist as ddist
from dtrain.engine.context import DistributedContext, TrialContext
from dtrain.errors import UserError
from dtrain.profiling.phases import PHASES

log = logging.getLogger(__name__)

# The phases each call marks: without context.backward the forward, backward and exposed communication are
# never split from the rest of train_batch; without context.step_optimizer the update is not.
BACKWARD_PHASES = ("forward", "backward", "comm_exposed")
STEP_PHASES = ("optimizer",)


def unobserved_phases(ctx: DistributedContext) -> list[str]:
    """The step phases this rank's trial left unmarked so far (none when it calls both), in PHASES order."""
    missing: set[str] = set()
    if not ctx.backward_calls:
        missing.update(BACKWARD_PHASES)
    if not ctx.step_optimizer_calls:
        missing.update(STEP_PHASES)
        if ctx.strategy.exchanges_in_step:  # these strategies exchange gradients inside step_optimizer
            missing.add("comm_exposed")
    return [p for p in PHASES if p in missing]


def phases_warning(ctx: DistributedContext) -> str | None:
    """One line for a trial that does not call ``context.backward`` and/or ``context.step_optimizer``."""
    backward, step = not ctx.backward_calls, not ctx.step_optimizer_calls
    if not (backward or step):
        return None
    calls = [c for c, missed in (("self.context.backward(loss)", backward),
                                 ("self.context.step_optimizer(opt)", step)) if missed]
    raw = [c for c, missed in (("loss.backward()", backward), ("opt.step()", step)) if missed]
    effect = ("DDP still averages the gradients, but aggregation_frequency, 16-mixed loss scaling, on_nonfinite "
              "and the profile's phases do not work")
    return (f"train_batch did not call {' or '.join(calls)} in its first batch: call {' and '.join(calls)} "
            f"instead of {' / '.join(raw)}; {effect} (the doctor will not diagnose the step's phases)")


def check_first_batch(ctx: DistributedContext) -> list[str]:
    """After the first batch, on every rank: the chief warns about what it found. Returns the unobserved
    phases (the trial's code is the same on every rank, so every rank finds the same)."""
    strategy = ctx.strategy
    if not ctx.step_optimizer_calls and strategy.exchanges_in_step and strategy.dp_world > 1:
        # Not a warning: the slots would go on training apart, and 1 x B would no longer equal N x B/N.
        raise UserError(f"train_batch did not call self.context.step_optimizer(opt) in its first batch: sync.strategy "
                        f"{strategy.name} exchanges the gradients there, so the slots would train apart; call "
                        "self.context.step_optimizer(opt) instead of opt.step()")
    if ctx.is_chief and (line := phases_warning(ctx)) is not None:
        log.warning("%s", line)
    return unobserved_phases(ctx)


def warn_unread_hyperparameters(ctx: TrialContext) -> None:
    """At the end of a run, on every training rank (a collective): the chief names the hyperparameters no
    rank read. Not after the first batch: a trial may read one only at some batch or epoch, or on one rank."""
    _merge_reads(ctx)
    if ctx.is_chief and (line := ctx.hparam_reads.warning()) is not None:
        log.warning("%s", line)


def _merge_reads(ctx: TrialContext) -> None:
    """Every training rank's reads, once: a trial may read a hyperparameter on one rank only (a test's
    ``sleep_rank``, a rank-0-only logger), and that is still read."""
    group = ctx.strategy.dp_group
    if not ddist.is_distributed(group):
        return
    gathered: list[list[str] | None] = [None] * ddist.world_size(group)
    tdist.all_gather_object(gathered, sorted(ctx.hparam_reads.read), group=group)
    for names in gathered:
        ctx.hparam_reads.read.update(names or [])
