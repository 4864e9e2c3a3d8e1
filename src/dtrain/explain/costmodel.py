"""The one cost model: what a step costs on another slot count, node count, batch, thread count or option.

``dtrain plan``, the doctor's predicted gains, ``--verify``'s predicted column and ``dtrain bench``'s estimate
all ask :class:`CostModel`. It starts from one measured run (its ``profile.json``) and prices a step as

    step = data + compute + fixed + exchange / aggregation

* **compute** (forward + backward) per slot at per-slot batch ``b`` and ``t`` threads: ``a_t + c_t b`` from
  the end-of-run solo probe (the first rank alone at the run's thread count, one and every core, at the
  per-slot batch and twice it); thread counts in between follow Amdahl's ``s + p / t``. Times how much
  slots on one host slow each other down (memory bandwidth: the same probe on every rank at once, over
  the solo one) and how much a training step costs over the probe (hooks, autocast): both measured on
  the run. More threads than cores share them.
* **data** and **fixed** (optimizer, bookkeeping) as measured; data grows with the batch as probed.
* **exchange**: per bucket ``latency + bytes / rate`` of a ring all-reduce (``2(N-1)`` steps, ``2(N-1)/N`` of
  the bytes through each link), fitted to all-reduces of several sizes (:mod:`dtrain.profiling.commprobe`)
  on the run's own ranks, or by ``dtrain plan --probe`` in local processes, or a given link; plus what an
  exchange costs inside training beyond that (waking up, waiting for the slowest peer: the step's jitter
  grows with the expected maximum of ``N`` ranks), calibrated so the run reproduces its own step. fp16
  halves the bytes and adds the measured cast; PowerSGD sends the measured low-rank bytes, in two
  collectives per bucket, and adds its measured matmuls and QR.

Every input is recorded with where it came from (measured, probed, given, assumed), and every prediction
carries an 80% interval from the run's own step-to-step drift and the uncertainty of each input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from dtrain.profiling.commprobe import LinkFit, fit
from dtrain.profiling.record import ProfileRecord

# z of the 80% two-sided normal interval.
Z80 = 1.2816
# DDP's buckets: the first gradients go out in a small bucket so communication starts early, then bucket_cap_mb.
FIRST_BUCKET_BYTES, BUCKET_BYTES = 1 * 2**20, 25 * 2**20
# Relative uncertainties (one standard deviation) of inputs that were not measured on the run itself;
# sized so that docs/benchmarks.md's held-out rows fall inside the 80% interval as often as it says.
ASSUMED = {"contention": 0.15, "threads": 0.10, "link_probe": 0.30, "link_given": 0.20, "batch_extrapolation": 0.10,
           "exchange_overhead": 0.30, "compute": 0.05}


@dataclass(frozen=True, slots=True)
class Link:
    """Between hosts: bytes per second and seconds of latency per ring step (None: as measured)."""

    bytes_per_second: float | None
    latency_seconds: float
    label: str


@dataclass(frozen=True, slots=True)
class Source:
    """One input of the model and where it came from."""

    name: str
    value: str
    source: str  # "measured" (the run), "probed" (dtrain plan --probe), "given" (--link), "assumed"


@dataclass(frozen=True, slots=True)
class Target:
    """A configuration to price. None fields: as the measured run had it."""

    slots: int
    nodes: int = 1
    global_batch: int | None = None
    threads: int | None = None  # per slot; None: the launcher's rule (cores // local slots, at least 1)
    aggregation: int | None = None
    compression: str | None = None
    one_bucket: bool = False
    precision_gain: float = 1.0
    data_workers_step: float | None = None  # the data wait with other loader processes (the doctor's plan)
    cores: int | None = None  # per host; None: as many as the run's host had


@dataclass(frozen=True, slots=True)
class Prediction:
    """Seconds per step by part, the step, and its 80% interval; samples/s the same way."""

    target: Target
    parts: dict[str, float]
    step: float
    low: float
    high: float
    global_batch: int

    @property
    def samples_per_second(self) -> float:
        return self.global_batch / self.step

    @property
    def samples_per_second_low(self) -> float:
        return self.global_batch / self.high

    @property
    def samples_per_second_high(self) -> float:
        return self.global_batch / self.low


def expected_max(n: int) -> float:
    """Expected maximum of ``n`` standard normal draws (the slowest of ``n`` ranks, in standard deviations)."""
    exact = {1: 0.0, 2: 0.5642, 3: 0.8463, 4: 1.0294, 5: 1.1630, 6: 1.2672, 7: 1.3522, 8: 1.4236}
    if n in exact:
        return exact[n]
    root = math.sqrt(2 * math.log(n))
    return root - (math.log(math.log(n)) + math.log(4 * math.pi)) / (2 * root)


def ring(n: int) -> float:
    """Share of an all-reduce's bytes that cross each link of a ring of ``n``."""
    return 2 * (n - 1) / n if n > 1 else 0.0


@dataclass(frozen=True, slots=True)
class RingLink:
    """A link as a ring all-reduce sees it: seconds per ring step and bytes per second through each link."""

    step_latency: float
    busbw: float

    @classmethod
    def from_fit(cls, link: LinkFit, world: int) -> RingLink:
        return cls(link.latency / (2 * (world - 1)), link.rate * ring(world))

    def allreduce(self, nbytes: float, world: int) -> float:
        if world < 2:
            return 0.0
        return 2 * (world - 1) * self.step_latency + ring(world) * nbytes / self.busbw


@dataclass(frozen=True, slots=True)
class Work:
    """Forward + backward seconds of one slot alone: ``overhead + per_sample x batch`` per thread count."""

    points: dict[int, tuple[float, float]]  # threads -> (overhead, per-sample seconds)

    @classmethod
    def from_pairs(cls, batch: int, pairs: dict[int, tuple[float, float]]) -> Work:
        """From (seconds at ``batch``, seconds at twice it) per thread count."""
        points = {}
        for threads, (one, two) in pairs.items():
            per_sample = max(0.0, (two - one) / batch)
            points[threads] = (max(0.0, one - per_sample * batch), per_sample)
        return cls(points)

    def seconds(self, batch: float, threads: int) -> float:
        if threads in self.points or len(self.points) == 1:
            a, c = self.points.get(threads, next(iter(self.points.values())))
            return a + c * batch
        lo, hi = min(self.points), max(self.points)
        t = min(max(threads, lo), hi)
        # Amdahl between the fewest and most threads probed: s + p / t through both points.
        at_lo = self.points[lo][0] + self.points[lo][1] * batch
        at_hi = self.points[hi][0] + self.points[hi][1] * batch
        p = (at_lo - at_hi) / (1 / lo - 1 / hi)
        return at_hi - p / hi + p / t

    def probed(self, threads: int) -> bool:
        return threads in self.points


@dataclass(frozen=True, slots=True)
class CompressionFacts:
    """Seconds per exchange of compressing the gradients, and the bytes PowerSGD sends."""

    fp16_seconds: float
    powersgd_seconds: float
    powersgd_bytes: float


@dataclass(frozen=True, slots=True)
class Facts:
    """What the model knows of one configuration that ran (or, on paper, that was described): the inputs of
    :class:`CostModel`, typed, from :meth:`from_profile` or :mod:`dtrain.explain.paper`."""

    slots: int
    hosts: int
    device: str  # "cpu" | "cuda": on a GPU, DDP's all-reduce overlaps the backward compute
    cores: int  # per host
    threads: int  # per slot
    per_slot_batch: int
    global_batch: int
    parameters: int
    aggregation: int
    compression: str
    fusion_mb: float | None
    buckets: float  # per exchange, as measured (0: not measured)
    data: float  # seconds per step, means over ranks
    compute: float  # forward + backward
    backward_share: float  # of compute
    fixed: float  # optimizer + other
    step: float
    work: Work  # one slot alone, by batch and threads
    threads_probed: bool
    concurrent_work: float | None  # the probe at the run's batch, all local slots at once
    load_growth: float  # 0 (per-step) .. 1 (per-sample) of data loading
    link_points: tuple[tuple[float, float], ...] = ()
    link_world: int = 0
    compression_costs: CompressionFacts | None = None
    train_latency: float = 0.0  # a one-float all-reduce after the run, seconds
    train_algbw: float = 0.0  # bytes per second the run's own exchanges achieved (0: not measured)
    jitter: float = 0.0  # standard deviation of a step
    windows: tuple[float, ...] = ()  # mean step of successive windows of the run

    @classmethod
    def from_profile(cls, p: ProfileRecord) -> Facts:
        work, threads_probed = _work(p)
        costs = p.compression_cost
        compute = _mean_compute(p)
        return cls(
            slots=p.slots, hosts=p.hosts, device=p.device, cores=p.cpu_cores or 1, threads=p.threads_per_slot,
            per_slot_batch=p.per_slot_batch_size, global_batch=p.global_batch_size, parameters=p.parameters,
            aggregation=p.aggregation_frequency or 1, compression=p.gradient_compression,
            fusion_mb=p.tensor_fusion_threshold_mb,
            buckets=p.comm.buckets_per_step * (p.aggregation_frequency or 1) if p.slots > 1 else 0.0,
            data=_mean_phase(p, "data"), compute=compute,
            backward_share=_mean_phase(p, "backward") / compute if compute > 0 else 0.5,
            fixed=_mean_phase(p, "optimizer") + _mean_phase(p, "other"), step=p.seconds_per_step.step.mean,
            work=work, threads_probed=threads_probed and p.solo_probe is not None,
            concurrent_work=p.batch_scaling.work_seconds if p.batch_scaling is not None else None,
            load_growth=_growth(p)[1],
            link_points=tuple((c.bytes, c.seconds) for c in p.comm_probe.points) if p.comm_probe else (),
            link_world=p.comm_probe.world if p.comm_probe else 0,
            compression_costs=(CompressionFacts(costs.fp16_seconds, costs.powersgd_seconds, costs.powersgd_bytes)
                               if costs is not None else None),
            train_latency=p.comm.latency_seconds, train_algbw=p.comm.algbw_bytes_per_second,
            jitter=p.step_jitter_seconds or 0.0, windows=tuple(p.step_window_seconds or ()))

    @property
    def local_slots(self) -> int:
        return max(1, self.slots // self.hosts)

    @property
    def crowd(self) -> float:
        """Threads over cores on a host, where beyond one: slots then take turns on the cores."""
        return max(1.0, self.local_slots * self.threads / self.cores) if self.device == "cpu" else 1.0


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

    # ------------------------------------------------------------------------------ building
    @classmethod
    def from_profile(cls, profile: ProfileRecord, probe: list[tuple[float, float]] | None = None,
                     probe_world: int = 2, probe_overhead: float | None = None,
                     between_hosts: Link | None = None) -> CostModel:
        """The model of ``profile``'s run. ``probe``: ``dtrain plan --probe``'s all-reduce points among
        ``probe_world`` local processes and its in-training exchange overhead, for a run with one slot."""
        return cls.from_facts(Facts.from_profile(profile), probe, probe_world, probe_overhead, between_hosts)

    @classmethod
    def from_facts(cls, f: Facts, probe: list[tuple[float, float]] | None = None, probe_world: int = 2,
                   probe_overhead: float | None = None, between_hosts: Link | None = None,
                   link_source: str = "measured") -> CostModel:
        sources = [Source("compute vs batch and threads", _describe(f.work), "measured" if f.threads_probed
                          else "measured at the run's threads only (other thread counts assumed the same)")]
        solo = f.work.seconds(f.per_slot_batch, f.threads)
        concurrent = f.concurrent_work if f.concurrent_work is not None else solo
        contention = max(1.0, concurrent / solo) if f.slots > 1 and solo > 0 and f.threads_probed else 1.0
        # A step's compute over the probe's: on one slot, the training loop's own cost (hooks, timer, autocast);
        # with several, also the exchange's (DDP's hooks, the backend's threads on the same cores): there it
        # is left to the calibrated exchange cost, which only multi-slot targets pay.
        factor = f.compute / (solo * contention * f.crowd) if solo > 0 and f.slots == 1 else 1.0
        link, found_source, residual = None, "none", 0.0
        if f.link_points:
            fitted = fit(list(f.link_points))
            link, found_source, residual = RingLink.from_fit(fitted, f.link_world), link_source, fitted.residual
        elif probe:
            fitted = fit(probe)
            link, found_source, residual = RingLink.from_fit(fitted, probe_world), "probed", fitted.residual
        elif f.slots > 1 and f.train_algbw > 0:
            # No all-reduce probe (a run of an older dtrain): the rate its exchanges achieved and the one-float
            # latency, which mix the link with training's own waiting: looser.
            fitted = LinkFit(f.train_latency, f.train_algbw, 0.5)
            link, found_source, residual = RingLink.from_fit(fitted, f.slots), link_source, fitted.residual
        model = cls(f, link, found_source, residual, between_hosts, 0.0, "none", factor, contention, sources)
        if link is not None:
            sources.append(Source("link among local slots", f"{1e6 * link.step_latency:.0f} us per ring step, "
                                  f"{link.busbw / 1e6:,.0f} MB/s (fit residual {100 * residual:.0f}%)", found_source))
        if f.slots > 1 and found_source in ("measured", "none"):  # no link: the whole exchange is overhead
            model.overhead, model.overhead_source = model._calibrated_overhead(), "measured"
        elif probe_overhead is not None:
            model.overhead, model.overhead_source = probe_overhead, "probed"
        if model.overhead_source != "none":
            sources.append(Source("exchange cost in training beyond the link", f"{1e3 * model.overhead:.2f} ms",
                                  model.overhead_source))
        if between_hosts is not None:
            sources.append(Source("link between hosts", between_hosts.label, "given"))
        return model

    def measured_target(self) -> Target:
        f = self.facts
        return Target(f.slots, f.hosts, f.global_batch, f.threads, f.aggregation, f.compression)

    def _calibrated_overhead(self) -> float:
        """Per-exchange seconds that make the run reproduce its own step (waiting, waking up, DDP's own work),
        beyond the jitter part that :meth:`predict` adds back per slot count."""
        f = self.facts
        parts = replace(self, overhead=0.0)._parts(self.measured_target())
        measured = (f.step - parts["data"] - parts["compute"] - parts["fixed"]) * f.aggregation
        bare = parts["exchange"] * f.aggregation
        # What overlapped with backward can make the measured exchange cheaper than the bare ring: down to half.
        return max(-0.5 * bare, measured - bare)

    # ----------------------------------------------------------------------------- predicting
    def local_threads(self, target: Target) -> tuple[int, int]:
        """(local slots, threads per slot) of ``target`` by the launcher's rule."""
        local = max(1, math.ceil(target.slots / target.nodes))
        cores = target.cores or self.facts.cores
        threads = target.threads if target.threads is not None else max(1, cores // local)
        return local, threads

    def _contention(self, local: int) -> float:
        run_local = self.facts.local_slots
        if local == 1:
            return 1.0
        if run_local > 1:  # measured at the run's local slots: more or fewer scale the excess linearly
            return 1.0 + (self.contention - 1.0) * (local - 1) / (run_local - 1)
        return 1.0  # not measured (one local slot): assumed none, with its uncertainty in the interval

    def buckets(self, nbytes: float, one_bucket: bool) -> list[float]:
        """Bucket sizes of one exchange: as many as the run measured, else DDP's default layout."""
        f = self.facts
        if one_bucket:
            return [nbytes]
        count = f.buckets
        if count < 1:
            cap = (f.fusion_mb or 0) * 2**20 or BUCKET_BYTES
            count = 1 + math.ceil(max(0.0, nbytes - FIRST_BUCKET_BYTES) / cap)
        count = max(1, round(count))
        return [nbytes / count] * count

    def _parts(self, target: Target) -> dict[str, float]:
        f = self.facts
        local, threads = self.local_threads(target)
        cores = target.cores or f.cores
        crowd = max(1.0, local * threads / cores) if f.device == "cpu" else 1.0
        gbs = target.global_batch or f.global_batch
        batch = gbs / target.slots
        compute = (f.work.seconds(batch, threads) * self._contention(local) * self.factor * crowd
                   / target.precision_gain)
        ratio = batch / f.per_slot_batch if f.per_slot_batch else 1.0
        data = f.data / f.crowd * (1 + f.load_growth * (ratio - 1)) * crowd
        if target.data_workers_step is not None:
            data = target.data_workers_step
        fixed = f.fixed / f.crowd * crowd
        exchange = compression = 0.0
        if target.slots > 1:
            exchange, compression = self._exchange(target, crowd, compute * f.backward_share)
        aggregation = target.aggregation or f.aggregation
        return {"data": data, "compute": compute, "fixed": fixed, "exchange": (exchange + compression) / aggregation,
                "compression": compression / aggregation}

    def _exchange(self, target: Target, crowd: float, backward: float) -> tuple[float, float]:
        """(seconds of one gradient exchange on the wire and waiting, seconds of compression math)."""
        f = self.facts
        n = target.slots
        nbytes = 4.0 * f.parameters
        compression = target.compression if target.compression is not None else f.compression
        math_seconds, collectives = 0.0, 1
        costs = f.compression_costs
        if compression in ("fp16", "bf16"):
            nbytes /= 2
            math_seconds = costs.fp16_seconds if costs is not None else 0.0
        elif compression == "powersgd" and costs is not None:
            nbytes, math_seconds, collectives = costs.powersgd_bytes, costs.powersgd_seconds, 2
        link = self.link or RingLink(0.0, float("inf"))
        between = self.between_hosts if target.nodes > 1 else None
        sizes = self.buckets(nbytes, target.one_bucket)
        times = []
        for size in sizes:
            seconds = 0.0
            for _ in range(collectives):
                part = size / collectives
                seconds += link.allreduce(part, n)
                if between is not None:
                    if between.bytes_per_second is not None:  # the slower link sets the ring's rate
                        seconds += max(0.0, ring(n) * part / between.bytes_per_second - ring(n) * part / link.busbw)
                    seconds += 2 * (n - 1) * between.latency_seconds
            times.append(seconds * (crowd if target.nodes == 1 else 1.0))
        wire = sum(times)
        if f.device == "cuda" and collectives == 1:
            # DDP launches each bucket as backward fills it: all but the last hide behind the rest of backward.
            wire = max(times[-1], wire - backward)
        # Waking up and waiting for the slowest of n ranks: the run's step jitter, the expected maximum of n.
        # (The calibrated overhead is what remains beyond this at the run's own slot count.)
        jitter = f.jitter * expected_max(n)
        return max(0.0, wire + self.overhead + jitter), math_seconds

    def predict(self, target: Target) -> Prediction:
        """Seconds per step of ``target``, by part, with its 80% interval."""
        parts = self._parts(target)
        step = parts["data"] + parts["compute"] + parts["fixed"] + parts["exchange"]
        if target.slots > 1:
            # Never beyond linear: N slots do at most N times what one slot with a host's cores does (a probe's
            # noise between thread counts must not read as superlinear scaling).
            one = self._parts(replace(target, slots=1, nodes=1, threads=None))
            step = max(step, (one["data"] + one["compute"] + one["fixed"]) / target.slots)
        spread = Z80 * self._sigma(target, parts, step) / step  # relative: a step is never negative
        gbs = target.global_batch or self.facts.global_batch
        return Prediction(target, {**parts, "step": step}, step, step * math.exp(-spread), step * math.exp(spread), gbs)

    def _sigma(self, target: Target, parts: dict[str, float], step: float) -> float:
        """One standard deviation of the predicted step: drift over the run, plus each input's uncertainty."""
        f = self.facts
        u = ASSUMED
        local, threads = self.local_threads(target)
        compute_u = u["compute"]
        if not f.work.probed(threads):
            compute_u += u["threads"]
        if local > 1 and f.local_slots == 1:
            compute_u += u["contention"]
        batch = (target.global_batch or f.global_batch) / target.slots
        compute_u += u["batch_extrapolation"] * abs(math.log(batch / f.per_slot_batch))
        comm_u = 0.0
        if target.slots > 1:
            comm_u = {"measured": 0.1, "probed": u["link_probe"]}.get(self.link_source, u["link_given"])
            comm_u += self.link_residual
            if self.overhead_source != "measured":
                comm_u += u["exchange_overhead"]
            if target.nodes > 1:
                comm_u += u["link_given"]
            comm_u += 0.1 * abs(math.log(target.slots / max(2, f.slots)))
        parts_sigma = math.hypot(compute_u * parts["compute"], comm_u * parts["exchange"], 0.05 * parts["data"])
        return math.hypot(_drift(f.windows) * step, parts_sigma)


def ratio(new: Prediction, base: Prediction) -> tuple[float, float, float]:
    """samples/s of ``new`` over ``base`` (same model: its biases cancel), with an 80% interval from
    ``new``'s own (the base is the measured run)."""
    value = new.samples_per_second / base.samples_per_second
    base_sps = base.samples_per_second
    return value, new.samples_per_second_low / base_sps, new.samples_per_second_high / base_sps


# -------------------------------------------------------------------------------- the run's figures
def _mean_phase(p: ProfileRecord, phase: str) -> float:
    return sum(r.seconds_per_step.of(phase) for r in p.per_rank) / len(p.per_rank)


def _mean_compute(p: ProfileRecord) -> float:
    return _mean_phase(p, "forward") + _mean_phase(p, "backward")


def _mean_step(p: ProfileRecord) -> float:
    return p.seconds_per_step.step.mean


def _growth(p: ProfileRecord) -> tuple[float, float]:
    """(work, loading) growth with the batch, 0 (all per-step overhead) to 1 (all per-sample)."""
    b = p.batch_scaling
    if b is None:
        return 1.0, 1.0

    def share(one: float, two: float) -> float:
        return min(1.0, max(0.0, two / one - 1.0)) if one > 0 and two > 0 else 1.0

    return share(b.work_seconds, b.work_double_seconds), share(b.load_seconds, b.load_double_seconds)


def _work(p: ProfileRecord) -> tuple[Work, bool]:
    """The solo probe's work by threads; without it the run's own (concurrent) probe, or its measured compute
    taken as proportional to the batch. Second: whether other thread counts were probed."""
    b = p.per_slot_batch_size or 1
    if p.solo_probe is not None and p.solo_probe.points:
        pairs = {w.threads: (w.work_seconds, w.work_double_seconds) for w in p.solo_probe.points}
        return Work.from_pairs(p.solo_probe.per_slot_batch_size, pairs), len(pairs) > 1
    if p.batch_scaling is not None:
        scaling = p.batch_scaling
        return Work.from_pairs(b, {p.threads_per_slot: (scaling.work_seconds, scaling.work_double_seconds)}), False
    compute = _mean_compute(p)
    return Work({p.threads_per_slot: (0.0, compute / b)}), False


def _describe(work: Work) -> str:
    return "; ".join(f"{t} thread(s): {1e3 * a:.3f} ms + {1e6 * c:.2f} us/sample" for t, (a, c) in
                     sorted(work.points.items()))


def _drift(windows: tuple[float, ...]) -> float:
    """Relative standard deviation of the run's mean step over its windows of steps (drift over the run), at
    least 3%; 5% where there are too few windows to tell."""
    if len(windows) < 3:
        return 0.05
    mean = sum(windows) / len(windows)
    var = sum((w - mean) ** 2 for w in windows) / (len(windows) - 1)
    return max(0.03, math.sqrt(var) / mean)
