"""``communication``: the exposed all-reduce time that moves bytes (bandwidth-bound), of the slowest rank
(it waits least for peers). Fewer bytes (fp16 compression, where the strategy can honour it) or fewer
exchanges (aggregation). A sharded (FSDP) run's all-gathers and reduce-scatters, where its end-of-run probe
took them out of forward and backward: a replica per slot (DDP), where the gathered model fit."""

from __future__ import annotations

from dtrain.explain import sharded
from dtrain.explain.diagnosis import Advice, Change
from dtrain.explain.factors import registry
from dtrain.explain.factors.base import AGGREGATION_TO_TRY, Context, Factor, aggregation_gain, mb, nothing_to_exchange
from dtrain.profiling.record import SHARDED


@registry.register
class Communication(Factor):
    name = "communication"

    def seconds(self, ctx: Context) -> float:
        return ctx.exposed * (1 - ctx.per_message)

    def advise(self, ctx: Context) -> Advice:
        if not ctx.exchanges:
            return nothing_to_exchange()
        if ctx.profile.exchange == SHARDED:
            return _sharded(ctx)
        profile, k = ctx.profile, AGGREGATION_TO_TRY
        comm = profile.comm
        aggregate = Change("optimizations.aggregation_frequency", k, aggregation_gain(ctx))
        why = (f"exposed {ctx.exchange_words} moves {mb(comm.bytes_per_step)} per step at "
               f"{mb(comm.algbw_bytes_per_second)}/s; aggregating {k} batches per exchange sends them a {k}th as "
               f"often (effective batch {k * ctx.global_batch})")
        # The strategy's capabilities are recorded in the profile from the strategy registry.
        if "fp16" not in profile.strategy_compressions:
            return Advice(aggregate.key, aggregate.value,
                          why + f"; sync.strategy {profile.strategy} cannot compress gradients",
                          aggregate.predicted_speedup)
        compress = Change("optimizations.gradient_compression", "fp16",
                          ctx.predictor.gain("optimizations.gradient_compression: fp16", compression="fp16"))
        lead, other = sorted((compress, aggregate), key=lambda c: c.predicted_speedup or 0.0, reverse=True)
        return Advice(lead.key, lead.value, why + "; fp16 compression halves the bytes", lead.predicted_speedup,
                      alternative=other)


def _sharded(ctx: Context) -> Advice:
    """FSDP's collectives, as its probe measured them, and DDP on the same slots by the cost model."""
    probe = ctx.profile.sharded_exchange
    if probe is None:
        return Advice(None, None, f"sync.strategy {ctx.profile.strategy} all-gathers and reduce-scatters inside "
                      "forward and backward, counted there (not probed apart: DDP's footprint would not fit on a "
                      "slot, a round failed, or the run was not profiled)", None)
    if ctx.exposed <= 0:
        return Advice(None, None, "FSDP's collectives took no time beyond the same steps with the parameters "
                      "held gathered (measured at the end of the run)", None)
    inside = ctx.compute + ctx.exposed
    why = (f"FSDP all-gathers each unit's parameters in forward and again in backward and reduce-scatters its "
           f"gradients: {1e3 * ctx.exposed:.2f} ms of the {1e3 * inside:.2f} ms of forward and backward (the same "
           f"steps with the parameters held gathered took {1e3 * ctx.compute:.2f} ms at the end of the run); the "
           "whole model, its gradients and the optimizer's state fit on every slot, so a replica per slot "
           "all-reduces the gradients once per step instead (its optimizer then steps every parameter on every "
           "slot: not priced)")
    instead = sharded.ddp_instead(ctx.profile)
    if instead is None:
        return Advice("sync.strategy", "ddp", why + "; no link was measured among the slots to price it", None)
    ctx.predictor.intervals["sync.strategy: ddp"] = (instead.low, instead.high)
    return Advice("sync.strategy", "ddp", why, instead.gain)
