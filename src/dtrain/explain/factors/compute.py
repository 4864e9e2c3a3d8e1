"""``compute``: the cost model's compute term at the run, the work every slot must do (less what a lower
precision was measured to save, which is the ``precision`` factor's, and what did not grow at twice the batch,
which is ``batch_size``'s)."""

from __future__ import annotations

from dtrain.explain.diagnosis import Advice
from dtrain.explain.factors import registry
from dtrain.explain.factors.base import Context, Factor


@registry.register
class Compute(Factor):
    name = "compute"

    def seconds(self, ctx: Context) -> float:
        return ctx.compute - ctx.precision_saved - ctx.compute_per_step

    def advise(self, ctx: Context) -> Advice:
        return Advice(None, None, "forward and backward compute: the useful work. A step dominated by it scales "
                      "well; a faster device or more slots are what make it faster", None)
