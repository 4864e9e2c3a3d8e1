"""``communication``: the exposed all-reduce time that moves bytes (bandwidth-bound), of the slowest rank
(it waits least for peers). Fewer bytes (fp16 compression, where the strategy can honour it) or fewer
exchanges (aggregation)."""

from __future__ import annotations

from dtrain.explain.diagnosis import Advice, Change
from dtrain.explain.factors import registry
from dtrain.explain.factors.base import AGGREGATION_TO_TRY, Context, Factor, aggregation_gain, mb, nothing_to_exchange


@registry.register
class Communication(Factor):
    name = "communication"

    def seconds(self, ctx: Context) -> float:
        return ctx.exposed * (1 - ctx.per_message)

    def advise(self, ctx: Context) -> Advice:
        if not ctx.exchanges:
            return nothing_to_exchange()
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
