"""``exchange``: the exposed gradient exchange per step, over the aggregation. Per bucket ``latency + bytes /
rate`` of a ring all-reduce (``2(N-1)`` steps, ``2(N-1)/N`` of the bytes through each link; across nodes on GPUs,
NCCL's tree where faster: ``CostModel.allreduce``, :mod:`dtrain.explain.network`), on the link the run's own
ranks fitted (or ``dtrain plan --probe``'s, or a given one); DDP hides all but the last bucket behind backward on
a GPU. Plus what an exchange costs in training beyond the link (waking up, waiting for the slowest of ``N``
ranks: the run's step jitter times the expected maximum of ``N``), calibrated so the run reproduces its own step.
fp16 and bf16 halve the bytes, sent at the rate the run's ranks timed fp16 all-reduces at, and add the measured
cast; PowerSGD sends its measured low-rank bytes in two collectives a bucket and adds its measured math and its
hook's host time. A parameter server's exchange, and a sharded run's collectives, are held as measured
(:mod:`dtrain.explain.exchange` says which changes that leaves priced)."""

from __future__ import annotations

from dtrain.explain import fitted
from dtrain.explain.facts import POWERSGD_MESSAGES
from dtrain.explain.network import expected_max
from dtrain.explain.terms import registry, shared_host
from dtrain.explain.terms.base import ASSUMED, FITTED, GIVEN, MEASURED, At, Input, Term, ms

# The interval's sources that are the exchange's (dtrain.explain.spread).
UNCERTAIN = ("link_measured", "link_probe", "link_given", "link_between_hosts", "inter_given", "exchange_overhead",
             "slot_extrapolation", "exchange_held", "sharded_scaled", "link fit residual",
             "the exchange without the late rank (not measured)")


@registry.register
class Exchange(Term):
    name = "exchange"
    uncertain = UNCERTAIN

    def seconds(self, at: At) -> float:
        f, model, target = at.facts, at.model, at.target
        exchange = compression = 0.0
        if f.sharded is not None:
            exchange = model.sharded_collectives(target)
        elif f.holds_exchange:  # on a crowded host its processes take turns on the cores too
            exchange = model.held_exchange * at.shape.crowd / shared_host.run_crowd(model)
        elif target.slots > 1:
            exchange, compression = _ring(at)
        aggregation = target.aggregation or f.aggregation
        at.detail["compression"] = compression / aggregation
        return (exchange + compression) / aggregation

    def inputs(self, at: At) -> list[Input]:
        f, model, target = at.facts, at.model, at.target
        if target.slots <= 1 and f.sharded is None and not f.holds_exchange:
            return []
        if f.holds_exchange:
            return [Input("exchange per update, held as measured", ms(model.held_exchange), MEASURED)]
        link = model.link
        source = {"none": ASSUMED}.get(model.link_source, model.link_source)
        nbytes = f.gradient_total
        size = f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.2f} kB"
        out = [Input("gradient bytes per exchange", size, MEASURED),
               Input("buckets", str(len(model.buckets(f.gradient_total, target.one_bucket, target.bucket_mb))),
                     MEASURED if target.bucket_mb is None and not target.one_bucket else GIVEN)]
        if link is not None:
            out.append(Input("link: latency per ring step, bus bandwidth",
                             f"{1e6 * link.step_latency:.0f} us, {link.busbw / 1e6:,.0f} MB/s", source))
        if model.between_hosts is not None and target.nodes > 1:
            out.append(Input("link between hosts", model.between_hosts.label, GIVEN))
        out += [Input("exchange cost in training beyond the link", ms(model.overhead),
                      {"none": ASSUMED}.get(model.overhead_source, model.overhead_source)),
                Input("step jitter (waiting for the slowest of N)", ms(_spread(at)), FITTED if f.batch_given
                      else MEASURED),
                Input("the run's exchange over the fitted link's", f"{model.exchange_scale:.2f}x", MEASURED)]
        aggregation = target.aggregation or f.aggregation
        if aggregation != 1:
            out.append(Input("batches per exchange", str(aggregation), GIVEN if target.aggregation else MEASURED))
        compression = target.compression if target.compression is not None else f.compression
        if compression not in (None, "none"):
            out.append(Input("compression", f"{compression} ({ms(at.detail.get('compression', 0.0))} of math)",
                             MEASURED if f.compression_costs is not None else ASSUMED))
        waits = shared_host.descheduled(model, target)
        if waits > 0:
            out.append(Input("a peer off its core, per collective (shared-host set)", ms(waits), FITTED))
        return out


def _ring(at: At) -> tuple[float, float]:
    """(seconds of one gradient exchange on the wire and waiting, seconds of compression math)."""
    f, model, target, crowd = at.facts, at.model, at.target, at.shape.crowd
    compute = at.parts["compute"]
    n = target.slots
    nbytes = f.gradient_total
    compression = target.compression if target.compression is not None else f.compression
    math_seconds, collectives = 0.0, 1
    costs = f.compression_costs
    if compression in ("fp16", "bf16"):
        nbytes /= 2
        math_seconds = costs.fp16_seconds if costs is not None else 0.0
    elif compression == "powersgd" and costs is not None:
        nbytes, math_seconds, collectives = costs.powersgd_bytes, costs.powersgd_seconds, POWERSGD_MESSAGES
    sizes = model.buckets(nbytes, target.one_bucket, target.bucket_mb)
    if compression == "powersgd" and costs is not None:
        # The probe times the hook's matmuls and QR; the hook's own Python and allocations run per bucket
        # and collective on the autograd thread, and on shared cores they take turns with the others.
        math_seconds += fitted.load().terms["powersgd_hook_seconds"] * len(sizes) * collectives * crowd
    descheduled = shared_host.descheduled(model, target)
    half = compression in ("fp16", "bf16")
    times = [sum(crowd * model.allreduce(size / collectives, target, half=half) + descheduled
                 for _ in range(collectives))
             for size in sizes]
    wire = sum(times)
    overlap = f.overlap if f.overlap is not None else f.device == "cuda"
    if overlap and collectives == 1:
        # DDP launches each bucket as backward fills it: all but the last hide behind the rest of backward.
        wire = max(times[-1], wire - compute * f.backward_share)
    # Waking up and waiting for the slowest of n ranks: the run's step jitter, the expected maximum of n.
    # (The calibrated overhead is what remains beyond this at the run's own slot count.)
    jitter = _spread(at) * expected_max(n)
    # More processes than cores: every exchange also waits for peers to get a core back, in proportion.
    waiting = (model.overhead + jitter * model.exchange_scale) * crowd / shared_host.run_crowd(model)
    return max(0.0, wire * model.exchange_scale + waiting), math_seconds


def _spread(at: At) -> float:
    """One standard deviation of a step: the run's jitter; on paper, where none was measured, one GPU's spread
    relative to its compute, fitted to published rows."""
    f = at.facts
    return f.jitter + (fitted.load().terms["paper_jitter"] * at.parts["compute"] if f.batch_given else 0.0)
