"""The one cost model: what a step costs on another slot count, node count, batch, thread count or option.

``dtrain plan``, the doctor's predicted gains, ``--try``, ``--verify``'s predicted column and ``dtrain bench``'s
estimate all ask :class:`CostModel`. Built from one measured run (its ``profile.json``, or :class:`Facts` on
paper), it prices a :class:`Target` as the sum of the registered terms (:mod:`dtrain.explain.terms`: compute,
data, fixed, exchange, late_rank; one file each, with its inputs and their sources), the exchange calibrated so
the run reproduces its own step. Every prediction carries an 80% interval (:mod:`dtrain.explain.spread`, its
uncertainties fitted to stored held-out rows: :mod:`dtrain.explain.fitted`), never reaching beyond linear
scaling, at most +/-25% of its point where every input was measured on this host. Where the run's model was not
timed at twice its batch, a prediction at another per-slot batch is halfway between all of its compute and loading
growing with the batch and none, and its interval spans both. docs/prediction.md explains the whole model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from dtrain.explain import fitted
from dtrain.explain import spread as spread_of
from dtrain.explain.facts import Facts, Work, linear_contention
from dtrain.explain.modelsources import Source, between_source, describe_work, link_words
from dtrain.explain.network import (
    TREE_BANDWIDTH,
    Link,
    RingLink,
    expected_max,
    ring,
    shaped_seconds,
    tree_latency_steps,
)
from dtrain.explain.target import Prediction, Target
from dtrain.explain.terms import registry as term_registry
from dtrain.explain.terms import shared_host
from dtrain.explain.terms.base import At, Input, Shape, TermValue, sd_of
from dtrain.profiling import buckets as ddp_buckets
from dtrain.profiling.commprobe import LinkFit, fit
from dtrain.profiling.record import ProfileRecord

__all__ = ["CostModel", "Link", "Prediction", "RingLink", "Source", "Target", "expected_max", "ring"]

# z of the 80% two-sided normal interval.
Z80 = 1.2816
# Where every input was measured on this host (the run, its probes, dtrain plan --probe), the interval is at
# most this far from its point (issue 45): wider says nothing a user can act on.
MEASURED_SPREAD = math.log(1.25)
# A prediction's widest input where the model's compute at another batch was not timed (CostModel.predict).
GROWTH_NOT_PROBED = "compute and loading at another batch (not timed after the run)"
# Inputs given rather than measured here (a link, a datasheet, a loader count the run did not use): an
# interval with one of them keeps its full width.
# A run's exchanges may beat the model's (its exchange is scaled down to match): at most this far (a run whose
# exchange cost nothing measurable says nothing about what it would cost elsewhere).
MIN_EXCHANGE_SCALE = 0.05
# The exchange term's name, and the parts that are a term's sub-figures rather than terms (not added to the step).
EXCHANGE = "exchange"
DETAILS = ("compression", "step")
# CostModel.explain's row for a step held at linear scaling from one slot (CostModel.predict).
LINEAR = "held at linear scaling"
NOT_MEASURED = ("link_given", "link_between_hosts", "compute_given", "inter_given", "loader_workers",
                "sharded_to_replica", "sharded_scaled", spread_of.LATE_GONE)


@dataclass
class CostModel:
    """Built from one run by :meth:`from_profile` (or from :class:`Facts`); :meth:`predict` prices a
    :class:`Target`."""

    facts: Facts
    link: RingLink | None  # among the run's ranks (or probed locally); None: no link known
    link_source: str
    link_residual: float
    between_hosts: Link | None
    overhead: float  # seconds per exchange beyond the ring's, in training (calibrated or probed)
    overhead_source: str
    factor: float  # a training step's compute over the probe's
    contention: float  # the run's local slots' compute over one slot alone (1 with one local slot)
    sources: list[Source] = field(default_factory=list)
    # The run's own exchange over the model's (link and waiting; calibrated), where the run's was faster: the
    # probe was pessimistic, so every term scales down alike, and fewer bytes save proportionally, never more.
    exchange_scale: float = 1.0
    # Seconds per exchange held as the run measured it, not priced from a link: a parameter server's push, the
    # servers' step and the pull (dtrain.explain.exchange says which changes leave it alone).
    held_exchange: float = 0.0
    # Seconds per step every rank waits for a chronically late rank (:meth:`_late_wait`); none on one slot.
    late: float = 0.0
    # The run's ranks' fp16 all-reduces, for the 16-bit compressions (None: not probed; fp32's rate for their bytes).
    half_link: RingLink | None = None
    # The optional set of a crowded, shared host's effects (dtrain.explain.terms.shared_host): on by default, as
    # the held-out rows were measured on such a host; off, the model of a host with a core per thread.
    shared_host: bool = True

    # ------------------------------------------------------------------------------ building
    @classmethod
    def from_profile(cls, profile: ProfileRecord, probe: list[tuple[float, float]] | None = None,
                     probe_world: int = 2, probe_overhead: float | None = None,
                     between_hosts: Link | None = None) -> CostModel:
        """The model of ``profile``'s run. ``probe``: ``dtrain plan --probe``'s all-reduce points among
        ``probe_world`` local processes and its in-training exchange overhead, for a run with one slot."""
        return cls.from_facts(Facts.of_profile(profile), probe, probe_world, probe_overhead, between_hosts)

    @classmethod
    def from_facts(cls, f: Facts, probe: list[tuple[float, float]] | None = None, probe_world: int = 2,
                   probe_overhead: float | None = None, between_hosts: Link | None = None) -> CostModel:
        how = ("measured" if f.threads_probed
               else "measured at the run's threads only (other thread counts assumed the same)")
        if not f.batch_growth_probed:
            how = ("measured at the run's batch and threads only (at another batch: between all of it growing with the "
                   "batch and none)")
        sources = [Source("compute vs batch and threads", describe_work(f.work), how)]
        busy = f.work.oversubscribed()
        if busy:
            sources.append(Source("thread counts probed while the cores were busy", ", ".join(map(str, busy)),
                                  "measured, not used: fewer threads count instead (re-run on a quiet host)"))
        solo = f.work.seconds(f.per_slot_batch, f.threads)
        concurrent = f.concurrent_work if f.concurrent_work is not None else solo
        contention = max(1.0, concurrent / solo) if f.slots > 1 and solo > 0 and f.threads_probed else 1.0
        # A step's compute over the probe's: on one slot, the training loop's own cost (hooks, timer, autocast);
        # with several, also the exchange's (DDP's hooks, the backend's threads on the same cores): there it
        # is left to the calibrated exchange cost, which only multi-slot targets pay. A held exchange is no
        # calibration: compute stays as measured, per step (aggregation must not divide it).
        own = f.slots == 1 or f.holds_exchange
        factor = f.compute / (solo * contention * f.crowd) if solo > 0 and own else 1.0
        link, found_source, residual = None, "none", 0.0
        if f.link_points:
            fitted = fit(list(f.link_points))
            link, found_source, residual = RingLink.from_fit(fitted, f.link_world), "measured", fitted.residual
        elif probe:
            fitted = fit(probe)
            link, found_source, residual = RingLink.from_fit(fitted, probe_world), "probed", fitted.residual
        elif f.slots > 1 and f.train_algbw > 0:
            # No all-reduce probe (a run of an older dtrain): the rate its exchanges achieved and the one-float
            # latency, which mix the link with training's own waiting: looser.
            fitted = LinkFit(f.train_latency, f.train_algbw, 0.5)
            link, found_source, residual = RingLink.from_fit(fitted, f.slots), "measured", fitted.residual
        model = cls(f, link, found_source, residual, between_hosts, 0.0, "none", factor, contention, sources)
        if f.holds_exchange:
            return model._held()
        if link is not None:
            sources.append(Source("link among local slots", link_words(link, residual), found_source))
        half = model.derive_from_facts()
        if model.half_link is not None and half is not None:
            sources.append(Source("fp16 all-reduces among local slots", link_words(model.half_link, half.residual),
                                  found_source))
        if f.slots > 1 and found_source in ("measured", "none"):  # no link: the whole exchange is overhead
            model.overhead, model.exchange_scale = model._calibrated_exchange()
            model.overhead_source = "measured"
        elif probe_overhead is not None:
            # The probe's exchanges waited for its peer already: the run's jitter is added back per slot count.
            model.overhead = max(0.0, probe_overhead - f.jitter * expected_max(probe_world))
            model.overhead_source = "probed"
        if model.exchange_scale < 1.0:
            sources.append(Source("exchange in training over the fitted link's", f"{model.exchange_scale:.2f}x "
                                  "(the run's exchanges beat the fit: its terms scaled to match)", "measured"))
        if model.overhead_source != "none":
            sources.append(Source("exchange cost in training beyond the link", f"{1e3 * model.overhead:.2f} ms",
                                  model.overhead_source))
        if between_hosts is not None:
            sources.append(between_source(between_hosts, f))
        return model

    def derive_from_facts(self) -> LinkFit | None:
        """Set what follows from the facts and the link alone: the fp16 link (its fit returned, None where the
        run probed none) and the late rank's wait. :meth:`from_facts` calls it, and so does a model rebuilt from
        its stored parts (:func:`dtrain.explain.calibration.model_from_json`), which must predict alike."""
        f = self.facts
        half = None
        if f.half_link_points and self.link is not None:
            half = fit(list(f.half_link_points))
            self.half_link = RingLink.from_fit(half, f.link_world)
        self.late = self._late_wait()
        return half

    def _held(self) -> CostModel:
        """This model with the run's exchange held as measured per update, not priced from a link: a parameter
        server's whatever its link; a sharded run's FSDP collectives, priced at other slots and hosts from them
        (:meth:`sharded_collectives`). The held exchange is all the run spent beyond its compute, data and
        fixed work."""
        self.held_exchange = max(0.0, self._measured_exchange())
        self.overhead_source = "measured"
        if self.facts.sharded is None:  # a server's exchange is no ring: no link is used, none is uncertain
            self.link, self.link_source, self.link_residual = None, "none", 0.0
            self.sources.append(Source("exchange per update (held as measured: not priced from a link)",
                                       f"{1e3 * self.held_exchange:.2f} ms", "measured"))
            return self
        self.sources.append(Source("FSDP's all-gathers and reduce-scatters per step (held as measured; at other "
                                   "slots and hosts what the ring on the run's link leaves of it grows with the "
                                   "ring's steps, and the ring is priced there)", f"{1e3 * self.held_exchange:.2f} ms",
                                   "measured"))
        if self.link is not None:
            self.sources.append(Source("link among the run's slots (FSDP's ring)",
                                       link_words(self.link, self.link_residual), self.link_source))
        if self.between_hosts is not None:
            self.sources.append(between_source(self.between_hosts, self.facts))
        return self

    def measured_target(self) -> Target:
        f = self.facts
        return Target(f.slots, f.hosts, f.global_batch, f.threads, f.aggregation, f.compression)

    def _calibrated_exchange(self) -> tuple[float, float]:
        """(per-exchange seconds, the exchange's scale) that make the run reproduce its own step.

        An exchange slower than the fitted link (waiting, waking up, DDP's own work, beyond the jitter part
        that :meth:`predict` adds back per slot count) is a per-exchange cost that fewer bytes do not shrink.
        One faster than the model's says the link (and the waiting) in training beat the probe's: the whole
        exchange scales down, bytes term included, never by a negative cost (which fewer bytes would not
        shrink, and which drove an exchange of half the bytes towards zero: issue 45's 10.7x)."""
        measured = self._measured_exchange()
        bare = self._model_exchange(1.0)
        if measured >= bare or self.link is None:
            return max(0.0, measured - bare), 1.0
        low, high = MIN_EXCHANGE_SCALE, 1.0
        if self._model_exchange(low) >= measured:
            return 0.0, low
        for _ in range(40):  # the exchange grows with the scale: bisect to where it meets the measured one
            mid = (low + high) / 2
            low, high = (mid, high) if self._model_exchange(mid) < measured else (low, mid)
        return 0.0, (low + high) / 2

    def _late_wait(self) -> float:
        """What the run spent per step beyond its data, compute, fixed work and the late rank's exchange, which
        is pure exchange (it waits for no one): the others' wait for it. Without it, that wait was calibrated
        as exchange, and 4x fewer exchanges were predicted 1.64x where a planted straggler measured 1.06x."""
        f = self.facts
        if f.late_exposed is None or f.slots < 2:
            return 0.0
        # As in any multi-slot run, the training's compute beyond the probe's is the exchange's (hooks, threads).
        beyond = max(0.0, f.late_compute - self._parts(self.measured_target())["compute"])
        return max(0.0, self._measured_exchange() / f.aggregation - f.late_exposed - beyond)

    def _measured_exchange(self) -> float:
        """Seconds per exchange the run spent beyond data, compute and fixed work."""
        f = self.facts
        parts = replace(self, overhead=0.0, exchange_scale=1.0, between_hosts=None,
                        held_exchange=0.0)._parts(self.measured_target())
        return (f.step - self.step_of(parts, but=(EXCHANGE,))) * f.aggregation

    def _model_exchange(self, scale: float) -> float:
        """Seconds per exchange the model gives the run itself with no calibrated overhead and ``scale``, on the
        link its own ranks measured (a given link between hosts is what a prediction changes, not the run)."""
        parts = replace(self, overhead=0.0, exchange_scale=scale, between_hosts=None)._parts(self.measured_target())
        return parts["exchange"] * self.facts.aggregation

    # ----------------------------------------------------------------------------- predicting
    def local_threads(self, target: Target) -> tuple[int, int]:
        """(local slots, threads per slot) of ``target`` by the launcher's rule."""
        local = max(1, math.ceil(target.slots / target.nodes))
        cores = target.cores or self.facts.cores
        threads = target.threads if target.threads is not None else max(1, cores // local)
        return local, threads

    def contention_at(self, local: int) -> float:
        """How much ``local`` slots on one machine slow each other's compute (linear in the other slots)."""
        # Not measured with one local slot: assumed none, with its uncertainty in the interval.
        return linear_contention(self.contention, local, self.facts.local_slots)

    def buckets(self, nbytes: float, one_bucket: bool, bucket_mb: float | None = None) -> list[float]:
        """Bucket sizes of one exchange of ``nbytes``: DDP's layout (:mod:`dtrain.profiling.buckets`) of the
        run's gradient tensors at its cap, or at ``bucket_mb`` (``tensor_fusion_threshold``), in proportion where
        the bytes are compressed. Where the run recorded no tensors (older profiles, paper) or measured another
        count: as many as it measured, at another cap scaled by DDP's layout of fine-grained tensors."""
        f = self.facts
        if one_bucket:
            return [nbytes]
        if f.gradient_bytes:
            sizes = ddp_buckets.model_layout(f.gradient_bytes, f.fusion_mb if bucket_mb is None else bucket_mb)
            if bucket_mb is not None or f.buckets < 1 or round(f.buckets) == len(sizes):
                total = sum(sizes) or 1
                return [nbytes * size / total for size in sizes]
        count = f.buckets
        if bucket_mb is not None:
            gradients = f.gradient_total  # DDP fills buckets with the gradients, compressed or not
            layout = ddp_buckets.count_without_tensors(gradients, bucket_mb)
            count = layout * count / ddp_buckets.count_without_tensors(gradients, f.fusion_mb) if count >= 1 else layout
        elif count < 1:
            count = ddp_buckets.count_without_tensors(nbytes, f.fusion_mb)
        count = max(1, round(count))
        return [nbytes / count] * count

    def _parts(self, target: Target) -> dict[str, float]:
        """Seconds per step of each registered term (:mod:`dtrain.explain.terms`) at ``target``, in their
        evaluation order, and the exchange's compression math (a share of its seconds, not a term)."""
        at = At(self, target, Shape.of(self, target))
        for term in term_registry.terms():
            at.parts[term.name] = term.seconds(at)
        return {**at.parts, **at.detail}

    @staticmethod
    def step_of(parts: dict[str, float], but: tuple[str, ...] = ()) -> float:
        """The step: the terms' seconds added up (``but``: less those named)."""
        return sum(seconds for name, seconds in parts.items() if name not in DETAILS and name not in but)

    def allreduce(self, nbytes: float, target: Target, tree: bool = True, half: bool = False) -> float:
        """Seconds of one all-reduce of ``nbytes``: the ring (or NCCL's tree, where faster) through the slower
        link, and each step's latency; ``half``: of 16-bit floats, at the rate they were measured at."""
        n, nodes = target.slots, target.nodes
        link = (self.half_link if half else None) or self.link or RingLink(0.0, float("inf"))
        wire, between_latency = ring(n) * nbytes / link.busbw, 0.0
        between = self.between_hosts if nodes > 1 else None
        if between is not None:
            terms = fitted.load().terms
            # A given rate counts frames on the wire; Gloo's TCP payload gets a share of it (headers, and the
            # peer's acknowledgements sharing the sender's link).
            payload = terms["tcp_goodput"] if self.facts.device == "cpu" else 1.0
            paced = 2 * (n - 1) * shaped_seconds(nbytes / n / payload, between, shared_host.shaper_tick(self))
            if self.facts.hosts > 1:
                # The run's ring crossed its hosts: the given link replaces the measured one between them (its
                # latency where longer than the measured ring step's, which holds the old link's and the software's).
                wire = paced if between.bytes_per_second is not None else wire
                between_latency = max(0.0, between.latency_seconds - link.step_latency)
            else:  # the slower link sets the ring's rate
                wire, between_latency = max(wire, paced), between.latency_seconds
        seconds = 2 * (n - 1) * (link.step_latency + between_latency) + wire
        if tree and self.facts.device == "cuda" and nodes > 1:
            within, across = tree_latency_steps(n, nodes)
            tree = within * link.step_latency + across * (link.step_latency + between_latency) + wire / TREE_BANDWIDTH
            seconds = min(seconds, tree)
        return seconds

    def sharded_collectives(self, target: Target) -> float:
        """FSDP's collectives per step at ``target``: the run's, beyond what the ring's latencies and bytes on its
        link account for (FSDP's copies, Gloo's or NCCL's own work, waiting for peers), per ring step as the run
        measured it, plus the ring's latencies and bytes at ``target`` (each all-gather or reduce-scatter is half
        a ring all-reduce: N-1 steps, (N-1)/N of its bytes through each link); none on one slot."""
        sharded = self.facts.sharded
        if sharded is None or target.slots <= 1:
            return 0.0
        here = self.measured_target()
        # The run's own ring, on the link it measured (a given link between hosts is what a prediction changes).
        ring_here = replace(self, between_hosts=None)._sharded_ring(here, sharded.collectives, sharded.nbytes)
        ring_there = self._sharded_ring(target, sharded.collectives, sharded.nbytes)
        if ring_here > self.held_exchange:  # the link fit was slower than the run's collectives: scaled to them
            return self.held_exchange * ring_there / ring_here
        steps = (target.slots - 1) / max(1, here.slots - 1)
        return (self.held_exchange - ring_here) * steps + ring_there

    def _sharded_ring(self, target: Target, collectives: int, nbytes: float) -> float:
        """FSDP's ``collectives`` moving ``nbytes`` in all by the ring alone (NCCL's all-gather and reduce-scatter
        run no tree)."""
        latency = self.allreduce(0.0, target, tree=False)
        return (collectives * latency + self.allreduce(nbytes, target, tree=False) - latency) / 2

    def predict(self, target: Target, interval: bool = True) -> Prediction:
        """Seconds per step of ``target``, by part, with its 80% interval (never faster than linear scaling
        from one slot, which no measured effect here allows); ``interval`` False: the point alone (a fit of the
        terms' constants, which needs thousands of them). At another per-slot batch of a model not timed at twice
        its batch: halfway between all of its compute and loading growing with the batch and none, spanning both."""
        f = self.facts
        if f.batch_growth_probed or f.batch_given or (target.global_batch or f.global_batch) / target.slots == (
                f.per_slot_batch):
            return self._predict(target, interval)
        grows = self._predict(target, interval)
        fixed_work = Work({t: (a + c * f.per_slot_batch, 0.0) for t, (a, c) in f.work.points.items()})
        fixed = replace(self, facts=replace(f, work=fixed_work, load_growth=0.0, load_increment=0.0),
                        sources=[])._predict(target, interval)
        parts = {name: (grows.parts[name] + fixed.parts[name]) / 2 for name in grows.parts}
        return Prediction(target, parts, parts["step"], min(grows.low, fixed.low), max(grows.high, fixed.high),
                          grows.global_batch, GROWTH_NOT_PROBED)

    def _predict(self, target: Target, interval: bool) -> Prediction:
        parts = self._parts(target)
        step = self.step_of(parts)
        linear = 0.0
        if target.slots > 1:
            # Never beyond linear: N slots do at most N times what one slot with a host's cores does (a probe's
            # noise between thread counts must not read as superlinear scaling).
            one = self._parts(replace(target, slots=1, nodes=1, threads=None, machine_slots=None))
            linear = self.step_of(one, but=(EXCHANGE,)) / target.slots
            step = max(step, linear)
        gbs = target.global_batch or self.facts.global_batch
        if not interval:
            return Prediction(target, {**parts, "step": step}, step, step, step, gbs)
        sigmas = spread_of.uncertainties(self, target, parts, step)
        spread = Z80 * math.sqrt(sum(v * v for v in sigmas.values())) / step  # relative: a step is never negative
        if not any(name in NOT_MEASURED for name in sigmas):
            spread = min(spread, MEASURED_SPREAD)
        widest = max(sigmas, key=lambda k: sigmas[k]) if sigmas else ""
        low = max(step * math.exp(-spread), linear)
        return Prediction(target, {**parts, "step": step}, step, low, step * math.exp(spread), gbs, widest)

    def explain(self, target: Target) -> list[TermValue]:
        """Each term's seconds at the run and at ``target`` (as :meth:`predict` gives them), one standard deviation
        of the target's from the interval's sources that are the term's, and its inputs with their sources."""
        here = self.measured_target()
        run, there = self.predict(here, interval=False).parts, self.predict(target).parts
        sigmas = spread_of.uncertainties(self, target, there, self.step_of(there))
        at = At(self, target, Shape.of(self, target))
        out = []
        for term in term_registry.terms():
            at.parts[term.name] = term.seconds(at)  # the inputs of a term may read an earlier one's
            inputs = tuple(term.inputs(at))
            if self.facts.batch_given:  # on paper nothing ran: what a run would have measured was given
                inputs = tuple(replace(i, source="given") if i.source in ("measured", "probed") else i for i in inputs)
            out.append(TermValue(term.name, run.get(term.name, 0.0), there.get(term.name, 0.0), sd_of(term, sigmas),
                                 inputs))
        held = [max(0.0, parts["step"] - self.step_of(parts)) for parts in (run, there)]
        if max(held) > 1e-12 * there["step"]:  # a step held at linear scaling: by how much
            out.append(TermValue(LINEAR, held[0], held[1], 0.0, (Input(
                "no more samples/s than the slots times one slot's", "a bound", "assumed"),)))
        return out
