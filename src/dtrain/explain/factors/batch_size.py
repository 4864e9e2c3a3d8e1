"""``batch_size``: per-step fixed costs (optimizer step, bookkeeping) of the fastest rank, and the part of its
forward + backward that did not grow at twice the batch (the model's own steps, measured: on a GPU, a host
queueing small kernels while the device waits); a bigger batch (as big as the device's memory allows) spreads
them over more samples."""

from __future__ import annotations

from dtrain.explain import advice
from dtrain.explain.diagnosis import Advice
from dtrain.explain.factors import registry
from dtrain.explain.factors.base import Context, Factor
from dtrain.explain.predictor import target_at

# Keep this share of the device's memory free when advising a bigger batch.
MEMORY_HEADROOM = 0.9
# profile.json's model_steps.double_batch_skipped where twice the batch did not fit.
OOM = "out of memory"


@registry.register
class BatchSize(Factor):
    name = "batch_size"

    def seconds(self, ctx: Context) -> float:
        return ctx.fixed + ctx.compute_per_step

    def advise(self, ctx: Context) -> Advice:
        profile, gbs = ctx.profile, ctx.global_batch
        if gbs <= 0:  # a script whose batches came from no DataLoader dtrain saw: no batch to scale
            return Advice(None, None, "the global batch is unknown (no DataLoader was seen), so a bigger one is not "
                          "priced; dtrain doctor --verify measures one", None)
        factor, memory_note = room(ctx)
        if factor < 1.25:
            return Advice(None, None, f"a bigger batch would amortize fixed costs, but it does not fit{memory_note}",
                          None)
        new_gbs = int(gbs * factor)
        per_step = ctx.compute_per_step
        flat = (f", and so did {1e3 * per_step:.2f} ms of forward and backward (the model's step at twice the batch "
                "took little longer, measured)" if per_step >= 0.05 * ctx.step else "")
        why = (f"optimizer step and bookkeeping cost the same whatever the batch{flat}; a bigger batch spreads them "
               f"(and communication) over more samples. {advice.batch_change(profile, new_gbs).text}{memory_note}")
        if not ctx.predictor.model.facts.batch_growth_probed:
            return _unprobed(ctx, new_gbs, why)
        # More samples per step: data and compute grow with them as probed; fixed costs and the exchange do not.
        return Advice("hyperparameters.global_batch_size", new_gbs, why,
                      ctx.predictor.gain(f"hyperparameters.global_batch_size: {new_gbs}", global_batch=new_gbs))


def _unprobed(ctx: Context, new_gbs: int, why: str) -> Advice:
    """The model was not timed at twice its batch: how much of its compute and loading grows with it is unknown,
    and the change is named with the top of what it could give, never advised on it (as precision's bound)."""
    target = target_at(ctx.predictor.model, global_batch=new_gbs)
    if (refused := ctx.predictor.refusal(target)) is not None:
        return Advice(None, None, f"{why}; not predicted: {refused}", None)
    top = ctx.predictor.predict(target).high
    return Advice("hyperparameters.global_batch_size", new_gbs,
                  f"{why}; the model was not timed at twice its batch after the run (rank 0's log says why): at most "
                  f"{top:.2f}x samples/s, if none of its compute and loading grew with the batch, not a prediction "
                  "(dtrain doctor --verify measures it)", None, bound=top)


def room(ctx: Context) -> tuple[float, str]:
    """How many times the batch fits (at most 2, in quarters) and a note on the memory it was judged by."""
    profile = ctx.profile
    factor = 2.0
    steps = profile.model_steps
    if steps is not None and steps.double_batch_seconds_per_step is None and steps.double_batch_skipped == OOM:
        # Measured: the model's own step at twice the per-slot batch ran out of memory at the end of the run.
        return 1.0, "; the model's step at twice the per-slot batch ran out of memory (measured)"
    facts = profile.device_facts
    on_gpu = facts is not None and facts.type == "cuda"
    peak = max((r.peak_memory_bytes for r in profile.per_rank), default=0.0)
    if facts is not None and on_gpu and peak > 0 and facts.total_memory_bytes:
        # Activations grow with the batch, weights and optimizer state do not: scaling the whole peak is
        # the conservative bound.
        fits = MEMORY_HEADROOM * facts.total_memory_bytes / peak
        return (min(factor, float(int(fits * 4) / 4)),
                f"; peak GPU memory {peak / 2**30:.1f} of {facts.total_memory_bytes / 2**30:.0f} GiB")
    if not on_gpu and peak > 0 and profile.memory_total_bytes:
        # CPU: every slot on a host holds its peak RSS (libraries included, which do not grow: conservative).
        total = profile.memory_total_bytes
        local = advice.local_slots(profile)
        fits = MEMORY_HEADROOM * total / (peak * local)
        return (min(factor, float(int(fits * 4) / 4)),
                f"; peak RSS {peak / 2**30:.2f} GiB per slot x {local} on a {total / 2**30:.0f} GiB host")
    return factor, ""
