"""``precision``: the part of the compute a lower precision saves, as the model's own steps timed in it at
the end of the run measured it. Where only matmul peaks were measured (a GPU with tensor cores and no timed
steps), the change is named with an upper bound and no prediction: only the matmul share of a step speeds
up, and its size is unknown (see :mod:`dtrain.explain.precision`)."""

from __future__ import annotations

from dtrain.explain.diagnosis import Advice
from dtrain.explain.factors import registry
from dtrain.explain.factors.base import Context, Factor
from dtrain.explain.predictor import target_at


@registry.register
class Precision(Factor):
    name = "precision"

    def seconds(self, ctx: Context) -> float:
        return ctx.precision_saved

    def advise(self, ctx: Context) -> Advice:
        found = ctx.lower_precision
        if found is None:
            return Advice(None, None, "no lower precision measured faster here (CPU, no tensor cores, or already "
                          "mixed precision)", None)
        run = ctx.profile.precision
        if found.gain is not None:
            action = f"precision: {found.precision}"
            return Advice("precision", found.precision,
                          f"the step is trained in {run}; {found.source}: forward and backward "
                          f"{found.gain:.2f}x as fast (weights stay float32; bf16 needs no loss scaling)",
                          ctx.predictor.gain(action, **found.changes()))
        target = target_at(ctx.predictor.model, precision_gain=found.bound or 1.0)
        if (why := ctx.predictor.refusal(target)) is not None:
            return Advice(None, None, f"the step is trained in {run}; {found.source}; no bound: {why}", None)
        bound = ctx.predictor.predict(target).value
        return Advice("precision", found.precision,
                      f"the step is trained in {run}; {found.source}: at most {bound:.2f}x samples/s, the bound if "
                      "the whole compute were matmuls, not a prediction (dtrain doctor --verify measures it)",
                      None, bound=bound)
