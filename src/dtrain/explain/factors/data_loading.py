"""``data_loading``: the mean wait for the next batch that every rank has; more loader processes per slot,
as many as the machine's cores and the probed load make worth it."""

from __future__ import annotations

from dtrain.explain.diagnosis import Advice
from dtrain.explain.factors import registry
from dtrain.explain.factors.base import Context, Factor, loader_gain


@registry.register
class DataLoading(Factor):
    name = "data_loading"

    def seconds(self, ctx: Context) -> float:
        return ctx.data

    def advise(self, ctx: Context) -> Advice:
        plan = ctx.loader
        return Advice("data_loader.num_workers", plan.workers,
                      f"slots wait {1e3 * ctx.data:.2f} ms per step for their next batch: {plan.why} (dtrain "
                      "bench --synthetic shows the ceiling)", loader_gain(ctx))
