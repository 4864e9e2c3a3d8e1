"""The cost model's inputs (:mod:`dtrain.explain.costmodel`), typed: what one configuration that ran (its
``profile.json``) or that was described on paper (:mod:`dtrain.explain.paper`) tells it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from dtrain.explain.advice import chronic_rank, own_work, probe_growth
from dtrain.explain.precision import batch_spread
from dtrain.profiling.record import ALL_REDUCE, SERVER, SHARDED, BatchScaling, ProfileRecord

# All-reduces PowerSGD sends per DDP bucket (dtrain.sync.powersgd: its P matrices, then its Q matrices).
POWERSGD_MESSAGES = 2


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
        """At ``batch`` samples with ``threads`` threads: never more than with fewer threads probed (a slot
        can always run fewer; a probe slower with more threads ran while other processes held the cores)."""
        return min(self._at(batch, t) for t in {threads, *(t for t in self.points if t < threads)})

    def _at(self, batch: float, threads: int) -> float:
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

    def oversubscribed(self) -> list[int]:
        """Thread counts probed slower than fewer threads (the cores were busy with other work then)."""
        return [t for t in self.points if any(self._at(2 * 64, t) > 1.5 * self._at(2 * 64, u)
                                              for u in self.points if u < t)]

    def probed(self, threads: int) -> bool:
        return threads in self.points


@dataclass(frozen=True, slots=True)
class CompressionFacts:
    """Seconds per exchange of compressing the gradients, and the bytes PowerSGD sends."""

    fp16_seconds: float
    powersgd_seconds: float
    powersgd_bytes: float


@dataclass(frozen=True, slots=True)
class ShardedFacts:
    """A sharded (FSDP) run's collectives per step: how many, the bytes they gather and scatter in all, the
    seconds its forward and backward spent beyond the end-of-run probe's with the parameters held gathered
    (the collectives and their waiting), and its optimizer step (of its shard: 1/slots of the parameters)."""

    collectives: int
    nbytes: float
    seconds: float
    optimizer: float


@dataclass(frozen=True, slots=True)
class Facts:
    """What the model knows of one configuration that ran (or, on paper, that was described): the inputs of
    :class:`CostModel`, typed, from :meth:`from_profile` or :mod:`dtrain.explain.paper`."""

    slots: int
    hosts: int
    device: str  # "cpu" | "cuda": slots on a CPU host share its cores (and its memory bandwidth)
    cores: int  # per host
    threads: int  # per slot
    per_slot_batch: int
    global_batch: int
    parameters: int
    aggregation: int
    compression: str
    fusion_mb: float | None
    buckets: float  # DDP's buckets per exchange, as measured (0: not measured)
    data: float  # seconds per step, means over ranks
    compute: float  # forward + backward
    backward_share: float  # of compute
    fixed: float  # optimizer + other
    step: float
    work: Work  # one slot alone, by batch and threads
    threads_probed: bool
    concurrent_work: float | None  # the probe at the run's batch, all local slots at once
    load_growth: float  # 0 (per-step) .. 1 (per-sample) of data loading
    # Seconds the end-of-run probe's in-thread load of twice the per-slot batch took beyond one batch's (0: not
    # probed): what a bigger batch adds to loading, where the run's data wait also holds per-batch costs (the
    # loader's iterator and sampler) that do not grow with it.
    load_increment: float = 0.0
    # The share of loading the probe spent on the CPU (the rest waited: disk, network, sleep); 1: not probed.
    # Only that share slows down where more processes than cores take turns.
    data_cpu_share: float = 1.0
    # One optimizer step of the first rank alone, by thread count, and of every rank at once at the run's
    # threads (empty, 0: not probed): the fixed part's own thread scaling and contention (memory traffic).
    optimizer_solo: tuple[tuple[int, float], ...] = ()
    optimizer_concurrent: float = 0.0
    link_points: tuple[tuple[float, float], ...] = ()
    link_world: int = 0
    half_link_points: tuple[tuple[float, float], ...] = ()  # the same ranks' fp16 all-reduces (bytes as sent)
    compression_costs: CompressionFacts | None = None
    train_latency: float = 0.0  # a one-float all-reduce after the run, seconds
    train_algbw: float = 0.0  # bytes per second the run's own exchanges achieved (0: not measured)
    overlap: bool | None = None  # whether the all-reduce overlaps backward (None: on a GPU, as DDP does)
    batch_given: bool = False  # on paper: compute at any batch is given (proportional), not extrapolated
    # Whether the end-of-run probe timed the model at twice its batch (False: none ran, as for a trial that steps
    # its own optimizer, and compute at another batch is taken in proportion to it: only a guess).
    batch_growth_probed: bool = True
    jitter: float = 0.0  # standard deviation of a step
    # A chronically late rank (None: none measured): its exposed exchange, which is pure exchange (it waits for
    # no one), and its data wait beyond the mean over ranks (the most of the others' wait for it that is loading).
    late_exposed: float | None = None
    late_data: float = 0.0
    late_compute: float = 0.0  # with a late rank: the training's own forward + backward (advice.own_work)
    windows: tuple[float, ...] = ()  # mean step of successive windows of the run
    batch_spread: float = 0.0  # relative sd of the model's own timed steps' growth to twice the batch (0: none)
    # Each model's trainable tensors' gradient bytes in backward's order (empty: not recorded): DDP's buckets.
    gradient_bytes: tuple[tuple[int, ...], ...] = ()
    # How the replicas talk (dtrain.explain.exchange): ALL_REDUCE is priced from a link; a SERVER exchange
    # is held as measured.
    exchange: str = ALL_REDUCE
    # A DDP model of a sharded (FSDP) run's slots (dtrain.explain.sharded): its compute and optimizer are FSDP's.
    replica_of_sharded: bool = False
    # A sharded run whose collectives were counted and taken out of its compute (its compute is then the probe's
    # with the parameters held gathered): they are held as measured and scaled by the ring to other slots.
    sharded: ShardedFacts | None = None

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
            buckets=_buckets(p),
            data=_mean_phase(p, "data"), compute=compute,
            backward_share=_mean_phase(p, "backward") / compute if compute > 0 else 0.5,
            fixed=_mean_phase(p, "optimizer") + _mean_phase(p, "other"), step=p.seconds_per_step.step.mean,
            work=work, threads_probed=threads_probed and p.solo_probe is not None,
            batch_growth_probed=bool(p.solo_probe and p.solo_probe.points) or p.batch_scaling is not None,
            concurrent_work=_concurrent_work(p),
            load_growth=probe_growth(p.batch_scaling)[1], load_increment=_load_increment(p),
            data_cpu_share=p.data_load_cpu_share if p.data_load_cpu_share is not None else 1.0,
            link_points=tuple((c.bytes, c.seconds) for c in p.comm_probe.points) if p.comm_probe else (),
            link_world=p.comm_probe.world if p.comm_probe else 0,
            half_link_points=tuple((c.bytes, c.seconds) for c in p.comm_probe.half_points) if p.comm_probe else (),
            compression_costs=(CompressionFacts(costs.fp16_seconds, costs.powersgd_seconds, costs.powersgd_bytes)
                               if costs is not None else None),
            train_latency=p.comm.latency_seconds, train_algbw=p.comm.algbw_bytes_per_second,
            jitter=p.step_jitter_seconds or 0.0, **_late(p), windows=tuple(p.step_window_seconds or ()),
            batch_spread=batch_spread(p.model_steps), optimizer_solo=_optimizer_solo(p),
            optimizer_concurrent=p.batch_scaling.optimizer_seconds if p.batch_scaling is not None else 0.0,
            gradient_bytes=tuple(tuple(model) for model in p.gradient_bytes or ()), exchange=exchange_kind(p))

    @classmethod
    def of_profile(cls, p: ProfileRecord) -> Facts:
        """:meth:`from_profile`, and for a sharded run whose collectives were counted, its collectives taken out
        of its compute (:func:`sharded_split`): what the cost model prices."""
        facts = cls.from_profile(p)
        found = sharded_split(p, facts.compute)
        probe = p.sharded_exchange
        if (facts.exchange != SHARDED or found is None or probe is None or not probe.collectives
                or facts.aggregation != 1):  # (with aggregation its reduce-scatters run once per update)
            return facts
        local, collectives = found
        batch = facts.per_slot_batch or 1
        # The batch probe timed forward and backward at the batch and twice it, FSDP's all-gathers in both (the
        # same bytes whatever the batch): what twice the batch added is the compute that grows with it, the rest
        # does not. Not probed: all of it in proportion to the batch (and said so). On a CPU, at fewer threads
        # in proportion to them (a slot's threads can do no more than all of its work; more are not assumed).
        grows = _sharded_growth(p.batch_scaling, local)
        points = {facts.threads: (local - grows, grows / batch)}
        if facts.device == "cpu" and facts.threads > 1:
            points[1] = ((local - grows) * facts.threads, grows * facts.threads / batch)
        sharded = ShardedFacts(probe.collectives, float(probe.collective_bytes or 0.0), collectives,
                               _mean_phase(p, "optimizer"))  # the run's optimizer stepped its shard
        return replace(facts, compute=local, work=Work(points), threads_probed=False, concurrent_work=None,
                       sharded=sharded)

    def to_json(self) -> dict[str, object]:
        """The facts as plain JSON (the stored held-out rows keep the inputs their predictions came from)."""
        out = asdict(self)
        out["work"] = {str(t): list(point) for t, point in self.work.points.items()}
        return out

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Facts:
        """The inverse of :meth:`to_json`."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        work = values.pop("work")
        costs = values.pop("compression_costs", None)
        sharded = values.pop("sharded", None)
        built = cls(**values, work=Work({int(t): (float(a), float(c))  # type: ignore[arg-type]
                                         for t, (a, c) in work.items()}))  # type: ignore[union-attr]
        return replace(built, sharded=ShardedFacts(**sharded) if isinstance(sharded, dict) else None,  # type: ignore[arg-type]
                       compression_costs=CompressionFacts(**costs) if isinstance(costs, dict) else None,
                       link_points=tuple(tuple(p) for p in built.link_points),  # type: ignore[misc]
                       half_link_points=tuple(tuple(p) for p in built.half_link_points),  # type: ignore[misc]
                       windows=tuple(built.windows),
                       optimizer_solo=tuple((int(t), float(s)) for t, s in built.optimizer_solo),
                       gradient_bytes=tuple(tuple(int(b) for b in model) for model in built.gradient_bytes))

    @property
    def gradient_total(self) -> float:
        """Bytes of gradients one exchange reduces: the trainable tensors' as recorded (frozen ones send
        nothing), else float32 gradients of every parameter."""
        return float(sum(map(sum, self.gradient_bytes))) if self.gradient_bytes else 4.0 * self.parameters

    @property
    def holds_exchange(self) -> bool:
        """Whether the model holds the run's exchange as measured (a parameter server's) rather than pricing it."""
        return self.exchange == SERVER or self.sharded is not None

    @property
    def local_slots(self) -> int:
        return max(1, self.slots // self.hosts)

    def optimizer_seconds(self, threads: int) -> float | None:
        """The solo probe's optimizer step at ``threads`` (the most threads probed up to it: a slot can always
        run fewer); None where not probed."""
        probed = [(t, s) for t, s in self.optimizer_solo if s > 0]
        fewer = [s for t, s in probed if t <= threads]
        if not probed:
            return None
        return min(fewer) if fewer else min(probed)[1]

    def optimizer_scale(self, threads: int, machine_slots: int) -> float | None:
        """The run's optimizer step at ``threads`` beside ``machine_slots`` slots over the run's own, by the probe's
        optimizer steps (alone at each thread count; every rank at once); None where not probed. An optimizer
        streams parameters, gradients and state through memory: threads and neighbours change it otherwise
        than the matmuls of forward and backward."""
        alone, at_run = self.optimizer_seconds(threads), self.optimizer_seconds(self.threads)
        if alone is None or at_run is None:
            return None
        measured = max(1.0, self.optimizer_concurrent / at_run) if self.optimizer_concurrent > 0 else 1.0
        return (alone / at_run * linear_contention(measured, machine_slots, self.local_slots)
                / linear_contention(measured, self.local_slots, self.local_slots))

    @property
    def crowd(self) -> float:
        """Threads over cores on a host, where beyond one: slots then take turns on the cores."""
        return max(1.0, self.local_slots * self.threads / self.cores) if self.device == "cpu" else 1.0


def exchange_kind(profile: ProfileRecord) -> str:
    """How the run's replicas talk: as recorded, else (a profile from before it was recorded) as the
    strategy's class says, else DDP's all-reduce."""
    if profile.exchange is not None:
        return profile.exchange
    from dtrain.sync import registry

    try:
        return registry.lookup(profile.strategy).exchange
    except KeyError:
        return ALL_REDUCE


def _sharded_growth(probe: BatchScaling | None, compute: float) -> float:
    """Seconds of a sharded run's ``compute`` (collectives out) that grow with the batch: what the batch probe's
    twice the batch added, at most all of it; all of it where not probed."""
    if probe is None or probe.work_seconds <= 0 or probe.work_double_seconds <= 0:
        return compute
    return min(compute, max(0.0, probe.work_double_seconds - probe.work_seconds))


def sharded_split(p: ProfileRecord, run_compute: float) -> tuple[float, float] | None:
    """A sharded run's forward and backward per step (``run_compute``) as (compute, collectives) by its
    end-of-run probe; None where not probed. The probe's least step with the parameters held gathered is the
    compute; all the rest of the run's mean counts as collectives: the run's steps beyond the probe's least are
    mostly waiting at them (each all-gather waits for the slowest rank, several times a step)."""
    probe = p.sharded_exchange
    if p.exchange != SHARDED or probe is None or probe.local_seconds <= 0:
        return None
    compute = min(run_compute, probe.local_seconds)
    return compute, max(0.0, run_compute - compute)


def linear_contention(measured: float, slots: int, run_slots: int) -> float:
    """How much ``slots`` slots on one machine slow each other, from ``measured`` at the run's ``run_slots``: the
    excess linear in the other slots; 1 alone, and where the run had one slot (not measured)."""
    if slots <= 1 or run_slots <= 1:
        return 1.0
    return 1.0 + (measured - 1.0) * (slots - 1) / (run_slots - 1)


# -------------------------------------------------------------------------------- the run's figures
def _concurrent_work(p: ProfileRecord) -> float | None:
    """The end-of-run probe's model step with every local slot at once (a mean over ranks), None where not
    probed or where a rank was chronically late: its own slowness is then in that mean, not the slots' contention
    (a planted straggler's 20 ms read as 16x contention on 4 slots, which priced their compute at 10.9 ms a step
    where each rank's forward and backward took 0.7 ms)."""
    if p.batch_scaling is None or chronic_rank(p) is not None:
        return None
    return p.batch_scaling.work_seconds


def _late(p: ProfileRecord) -> dict[str, float]:
    """A chronically late rank's ``late_exposed`` and ``late_data`` (:class:`Facts`); none where none was
    measured (ranks that take turns are noise, not a rank to wait for)."""
    rank = chronic_rank(p)
    if rank is None:
        return {}
    own = p.per_rank[rank].seconds_per_step
    return {"late_exposed": own.comm_exposed, "late_data": max(0.0, own.data - _mean_phase(p, "data")),
            "late_compute": own_work(p)[0]}


def _buckets(p: ProfileRecord) -> float:
    """DDP's buckets per exchange, from the all-reduces the run counted per step: PowerSGD sends two a bucket
    (its P and Q matrices; its vector-only buckets, and every bucket before its start iteration, one)."""
    if p.slots <= 1:
        return 0.0
    messages = p.comm.buckets_per_step * (p.aggregation_frequency or 1)
    return messages / POWERSGD_MESSAGES if p.gradient_compression == "powersgd" else messages


def _mean_phase(p: ProfileRecord, phase: str) -> float:
    return sum(r.seconds_per_step.of(phase) for r in p.per_rank) / len(p.per_rank)


def _optimizer_solo(p: ProfileRecord) -> tuple[tuple[int, float], ...]:
    if p.solo_probe is None:
        return ()
    return tuple((w.threads, w.optimizer_seconds) for w in p.solo_probe.points if w.optimizer_seconds > 0)


def _load_increment(p: ProfileRecord) -> float:
    probe = p.batch_scaling
    if probe is None or probe.load_seconds <= 0:
        return 0.0
    return max(0.0, probe.load_double_seconds - probe.load_seconds)


def _mean_compute(p: ProfileRecord) -> float:
    return _mean_phase(p, "forward") + _mean_phase(p, "backward")


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
