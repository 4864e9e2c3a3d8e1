"""``sync_frequency``: the exposed all-reduce time's per-message part (buckets x measured one-float
latency), a cost paid per synchronization that only syncing less often removes."""

from __future__ import annotations

from dtrain.explain.diagnosis import Advice
from dtrain.explain.factors import registry
from dtrain.explain.factors.base import AGGREGATION_TO_TRY, Context, Factor, aggregation_gain, nothing_to_exchange


@registry.register
class SyncFrequency(Factor):
    name = "sync_frequency"

    def seconds(self, ctx: Context) -> float:
        return ctx.exposed * ctx.per_message

    def advise(self, ctx: Context) -> Advice:
        if not ctx.exchanges:
            return nothing_to_exchange()
        comm, k = ctx.profile.comm, AGGREGATION_TO_TRY
        return Advice("optimizations.aggregation_frequency", k,
                      f"{comm.buckets_per_step:.0f} all-reduce(s) per step at {1e3 * comm.latency_seconds:.2f} ms "
                      f"latency each; exchanging gradients every {k} batches pays that once per {k} batches "
                      f"(effective batch {k * ctx.global_batch})", aggregation_gain(ctx))
