"""``straggler``: the rest of the step, time ranks spend waiting for the slowest rank. The rank is named
(host, lag, slow phase, what to check there) only when it is chronically last
(``stragglers.chronic_rank``): where ranks take turns no rank is to blame, and nothing is to try."""

from __future__ import annotations

from dataclasses import replace

from dtrain.explain import advice
from dtrain.explain.diagnosis import Advice, Change
from dtrain.explain.factors import registry
from dtrain.explain.factors.base import ONE_SLOT, Context, Factor, gains, loader_gain


@registry.register
class Straggler(Factor):
    name = "straggler"

    def seconds(self, ctx: Context) -> float:
        return ctx.straggler

    def advise(self, ctx: Context) -> Advice:
        """The config change is the real fix where one exists (a slow loader: more loader workers); one slot
        fewer is the fallback, predicted with the remaining slots doing its share of the batch, and offered
        only where it is predicted faster."""
        profile, late, waiting = ctx.profile, ctx.late, ctx.straggler
        if late is None:
            return Advice(None, None, "one slot: nothing to wait for", None)
        if not late.chronic:
            return Advice(None, None, advice.turns_text(late, waiting), None)
        fixed_speedup, fixed_interval = _fixed_gain(ctx)
        fewer = ctx.slots - 1
        leave_out = _fewer_slots_gain(ctx, fewer)
        leave = Change("resources.slots_per_trial", fewer, leave_out) if gains(leave_out) else None
        why = advice.straggler_text(late, f"resources.slots_per_trial: {fewer}", one_host=profile.hosts == 1,
                                    fallback_speedup=leave_out)
        late = replace(late, fixed_speedup=fixed_speedup, fixed_interval=fixed_interval)
        if late.phase == "data":  # a loader fix: the rank is always late, and late loading its batch
            return Advice("data_loader.num_workers", ctx.loader.workers, why,
                          loader_gain(ctx), alternative=leave, straggler=late)
        if leave is None:
            return Advice(None, None, why, None, straggler=late)
        return Advice(leave.key, leave.value, why, leave.predicted_speedup, straggler=late)


def _fixed_gain(ctx: Context) -> tuple[float, tuple[float, float] | None]:
    """The run with no one late, and its 80% interval: the cost model without the others' wait (its loading share
    out of the mean data wait too). Where the model holds no such wait (a strategy it does not price this way),
    the step less the factor's wait, with no interval."""
    action = "the straggler fixed"
    gain = ctx.predictor.gain(action, late_gone=True) if ctx.predictor.model.late > 0 else None
    if gain is not None:
        return gain, ctx.predictor.intervals[action]
    fixed = ctx.step - ctx.straggler
    return (ctx.step / fixed if fixed > 0 else float("inf")), None


def _fewer_slots_gain(ctx: Context, fewer: int) -> float | None:
    """One slot fewer, on the hosts that remain: the cost model re-prices the work and the exchange, and no one
    waits for the straggler, which left (one slot is the scaling estimate itself: one change, one prediction).
    Taking its lag off the priced step instead read a step shorter than the lag as a 2.8e10x gain (4 slots)."""
    profile = ctx.profile
    if fewer == ONE_SLOT[1]:
        return ctx.scaling.estimated_one_slot_speedup
    hosts = profile.hosts - 1 if profile.hosts > 1 and profile.slots // profile.hosts == 1 else profile.hosts
    return ctx.predictor.gain(f"resources.slots_per_trial: {fewer}", slots=fewer, nodes=max(1, hosts),
                              late_gone=True)
