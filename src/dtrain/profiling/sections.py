"""The sections of ``profile.json`` (:mod:`dtrain.profiling.record` holds the whole record and its file): each a
strict, frozen record of what a run measured, written as its fields in order."""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, field_validator, model_serializer

T = TypeVar("T")


class Section(BaseModel):
    """A part of ``profile.json`` or ``summary.json``: read strictly, never changed, written without the keys
    in ``OMITTED_WHEN_NONE`` that were not measured."""

    # strict: a profile is machine-written, so a string where a number belongs is damage, not a format to
    # accept (ints are still numbers); frozen: a record is what the run measured, not a scratch pad.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    # Keys the producer leaves out of the file (not measured) rather than writing null.
    OMITTED_WHEN_NONE: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_unmeasured(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in self.OMITTED_WHEN_NONE:
            if key in data and data[key] is None:
                del data[key]
        return data


class ByPhase(Section, Generic[T]):
    """One value per phase of a step (:data:`dtrain.profiling.phases.PHASES`) and for the whole ``step``."""

    data: T
    forward: T
    backward: T
    comm_exposed: T
    optimizer: T
    other: T
    step: T

    def of(self, phase: str) -> T:
        """The value of ``phase`` (a name from ``phases``, or ``"step"``)."""
        if phase not in type(self).model_fields:
            raise KeyError(phase)
        return getattr(self, phase)

    def items(self) -> list[tuple[str, T]]:
        """(phase, value) in the file's order: the phases, then ``step``."""
        return [(name, getattr(self, name)) for name in type(self).model_fields]


class Spread(Section):
    """Seconds per step across ranks: a straggler shows as a wide min-max."""

    min: float
    mean: float
    max: float


# One rank's seconds per step by phase; the spread of each across ranks.
PhaseSeconds = ByPhase[float]
PhaseSpread = ByPhase[Spread]


class WorkSeconds(Section):
    """Seconds per step of each work phase (every phase but ``comm_exposed``, the waiting itself)."""

    data: float
    forward: float
    backward: float
    optimizer: float
    other: float


class RankFigures(Section):
    """``per_rank[i]``: one rank's means."""

    rank: int
    host: str
    seconds_per_step: PhaseSeconds
    comm_busy_seconds_per_step: float
    comm_bytes_per_step: float
    comm_buckets_per_step: float
    peak_memory_bytes: float
    state_bytes: float


class Comm(Section):
    """``comm``: the gradient exchange, means over ranks (zeros with one slot)."""

    bytes_per_step: float
    buckets_per_step: float
    busy_seconds_per_step: float
    exposed_seconds_per_step: float
    algbw_bytes_per_second: float
    busbw_bytes_per_second: float
    latency_seconds: float


class RankLag(Section):
    """``stragglers.per_rank[i]``: how late one rank arrives at the gradient collectives."""

    rank: int
    host: str
    lag_median_seconds: float
    lag_p90_seconds: float
    lag_mean_seconds: float
    last_fraction: float
    slow_phase: str
    slow_phase_excess_seconds: float
    excess_seconds: WorkSeconds
    chronic: bool


class Stragglers(Section):
    """``stragglers`` (2+ slots): arrival lags per rank and the chronically late rank, if any."""

    samples: int
    lag_floor_seconds: float
    chronic_last_fraction: float
    chronic_rank: int | None
    per_rank: list[RankLag]


class MatmulTflops(Section):
    """Measured matmul TFLOPS per precision on a CUDA device."""

    fp32: float
    tf32: float
    bf16: float
    fp16: float

    def of(self, precision: str) -> float:
        """The TFLOPS of ``precision`` (``fp32``, ``tf32``, ``bf16`` or ``fp16``)."""
        if precision not in type(self).model_fields:
            raise KeyError(precision)
        return float(getattr(self, precision))


class DeviceFacts(Section):
    """``device_facts``: rank 0's device; ``cores`` on CPU, ``capability``, ``tensor_cores`` and
    ``matmul_tflops`` on CUDA (each absent from the file elsewhere)."""

    OMITTED_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"cores", "capability", "tensor_cores", "matmul_tflops"})

    type: str
    name: str
    cores: int | None = None
    capability: str | None = None
    tensor_cores: bool | None = None
    total_memory_bytes: float
    matmul_tflops: MatmulTflops | None = None


class LrHyperparameter(Section):
    """The ``lr``/``learning_rate`` hyperparameter, as the config gave it (an int stays an int)."""

    name: str
    value: int | float


class BatchScaling(Section):
    """``batch_scaling``: the end-of-run probe at the per-slot batch and twice it, and one optimizer step, every
    rank at once; means over ranks. ``optimizer_seconds`` is 0 in files of an older dtrain."""

    per_slot_batch_size: int
    work_seconds: float
    work_double_seconds: float
    load_seconds: float
    load_double_seconds: float
    optimizer_seconds: float = 0.0


class AllreduceProbe(Section):
    """``allreduce_probe`` (read, no longer written: ``comm_probe`` replaced it): one all-reduce size."""

    bytes: float
    seconds: float


class WorkPoint(Section):
    """The trial's forward and backward at one thread count, at the per-slot batch and twice it; one optimizer
    step (0 in files of an older dtrain)."""

    threads: int
    work_seconds: float
    work_double_seconds: float
    optimizer_seconds: float = 0.0


class SoloProbe(Section):
    """``solo_probe``: the first rank alone (the others idle) at the run's thread count, one and every core:
    what a slot does with the cores to itself, at other thread counts (CPU runs)."""

    per_slot_batch_size: int
    points: list[WorkPoint]


class CommPoint(Section):
    """One all-reduce size of :class:`CommProbe`: bytes and seconds (the lower quartile of its repeats)."""

    bytes: float
    seconds: float


class CommProbe(Section):
    """``comm_probe``: back-to-back all-reduces of several sizes among the run's ranks, on its backend."""

    world: int
    backend: str
    points: list[CommPoint]
    # fp16 all-reduces (bytes as sent), as the 16-bit compression hooks send them (empty: older profiles).
    half_points: list[CommPoint] = []


class CompressionCost(Section):
    """``compression_cost``: seconds per exchange of compressing this model's gradients (fp16 casts;
    PowerSGD's matmuls and QR at ``powersgd_rank``) and the bytes PowerSGD sends instead of all of them."""

    fp16_seconds: float
    powersgd_seconds: float
    powersgd_bytes: float
    powersgd_rank: int


class ShardedExchange(Section):
    """``sharded_exchange``: a sharded (FSDP) run's forward and backward at the end of the run, on every rank at
    once, least seconds: ``step_seconds`` as the run ran them (all-gathers and reduce-scatters inside),
    ``local_seconds`` with every parameter held gathered and no gradient reduced (as a replica per slot would
    run them); means over the ranks (:mod:`dtrain.profiling.shardprobe`); and how many collectives a step ran.
    """

    step_seconds: float
    local_seconds: float
    # FSDP's collectives per step and the bytes they move in all (absent: a profile of an older dtrain), which
    # the cost model scales to other slot and host counts (dtrain.explain.sharded).
    collectives: int | None = None
    collective_bytes: float | None = None


MODEL_STEPS_VERSION = 1


class ShapeTime(Section):
    """One more setting of :class:`ModelSteps`: a precision at ``batch_factor`` times the per-slot batch on
    ``threads`` torch threads, with its median seconds per step and their ``relative_spread`` (as there)."""

    precision: str
    batch_factor: int
    threads: int
    seconds: float
    relative_spread: float | None = None


class ProbeSkip(Section):
    """An entry of ``probes_skipped``: an end-of-run probe every rank skipped, and why (dtrain.profiling.probeguard)."""

    probe: str
    reason: str


class ModelSteps(Section):
    """``model_steps``: the model's own training steps (forward, backward and optimizer step on the run's
    data shape) timed on the first rank at the end of the run (:mod:`dtrain.profiling.modelsteps`), under each
    precision the device supports, and in the run's precision at twice the per-slot batch. Seconds per step
    are the median of ``steps_timed`` samples after untimed warm-up (a sample: one step; on a GPU, several
    in a row); ``cost_seconds`` is the whole probe's wall time (what it added to the run). Absent from the
    file where not probed."""

    version: int = MODEL_STEPS_VERSION
    per_slot_batch_size: int
    run_precision: str
    steps_timed: int
    # Precision name (32-true, tf32, bf16-mixed, 16-mixed) -> seconds per step at the per-slot batch.
    seconds_per_step: dict[str, float]
    # Precision name -> why it was not timed (the device lacks it, memory, an error).
    skipped: dict[str, str]
    # The run's precision at twice the per-slot batch; None with the reason in double_batch_skipped.
    double_batch_seconds_per_step: float | None
    double_batch_skipped: str | None
    cost_seconds: float
    # Setting (a precision name, or "double" for twice the batch) -> relative standard deviation of its timed
    # steps (their range over the least, scaled as a normal sample's range); empty in files of an older dtrain.
    relative_spread: dict[str, float] = {}
    # Setting -> the host's seconds per step to queue a sample (on a GPU, before the device caught up); and the
    # run's host seconds per step fetching a batch: what a host-bound step in another precision waits for too.
    host_seconds_per_step: dict[str, float] = {}
    loop_data_host_seconds: float | None = None
    # The torch threads the settings above ran on (None: an older dtrain), and the same steps at other shapes:
    # every other precision at twice the batch, and on a CPU every precision on another thread count; how a
    # precision's gain moves with the batch and the threads a change of slots gives (dtrain.explain.precision).
    threads: int | None = None
    shapes: list[ShapeTime] = []

    @field_validator("version")
    @classmethod
    def _known_version(cls, version: int) -> int:
        if version != MODEL_STEPS_VERSION:
            raise ValueError(f"model_steps version {version}; this dtrain reads version {MODEL_STEPS_VERSION}")
        return version

    @property
    def double_batch_ratio(self) -> float | None:
        """Seconds of a step at twice the per-slot batch over one at the batch (1: all overhead, 2: all
        per-sample), in the run's precision; None where not timed."""
        mine = self.seconds_per_step.get(self.run_precision)
        return self.double_batch_seconds_per_step / mine if mine and self.double_batch_seconds_per_step else None


class MembershipChange(Section):
    """An elastic job's change of members (dtrain.launcher.membership): at which batch, why, which node, the
    world sizes, seconds from the event to the first step at the new size, and the batches lost."""

    batches: int
    cause: str
    node: str | None
    old_world_size: int | None
    new_world_size: int
    seconds: float
    lost_batches: int
    event_time: float
    first_step_time: float
    time: float
    recovered_from: str | None = None  # a lost node: "survivors" (the state they held) or "checkpoint"
    fallback_reason: str | None = None  # why it went back to the latest checkpoint


class FirstSteps(Section):
    """``first_steps`` (dtrain.profiling.warmup): the time to the first step, and the first steps' excess."""
    OMITTED_WHEN_NONE: ClassVar[frozenset[str]] = frozenset(
        {"startup_seconds", "time_to_first_step_seconds", "allocator_segments", "allocator_segments_later"})
    startup_seconds: float | None = None
    first_step_seconds: float
    time_to_first_step_seconds: float | None = None
    steps: int
    seconds: float
    steady_step_seconds: float
    excess_seconds: float
    allocator_segments: int | None = None  # CUDA: memory segments the caching allocator created in them
    allocator_segments_later: int | None = None  # ... and in the rest of the run
    autotuning: list[str]


class Flops(Section):
    """``flops`` (dtrain.profiling.flops): FLOPs per step per slot over the measured matmul peak (MFU)."""
    flops_per_step: float
    flops_per_step_all_slots: float
    peak_flops_per_second: float
    peak: str
    mfu_per_slot: list[float]
    mfu: float


class ScriptModel(Section):
    """``script.models[i]``: one DDP model a script built, as it built it (what a change from outside moves)."""

    OMITTED_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"unused_parameter_bytes"})

    parameters: int
    # bucket_cap_mb as the script passed it (None: DDP's default, a 1 MiB first bucket then 25 MiB).
    bucket_cap_mb: float | None
    bucket_bytes_cap: int
    # DDP's comm hook by name (its logging data's), None without one: a script's own hook is named, not replaced.
    comm_hook: str | None
    find_unused_parameters: bool
    static_graph: bool
    gradient_as_bucket_view: bool
    broadcast_buffers: bool
    # With find_unused_parameters: the bytes of parameters DDP's reducer found unused in its last sampled
    # iteration (its logging data's unused_parameter_size; 0: the model used every one). Absent otherwise.
    unused_parameter_bytes: int | None = None


class ScriptLoader(Section):
    """``script.loader``: the DataLoader the steps drew their batches from (the one iterated with gradients on)."""

    batch_size: int | None
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    # Iterators started on it during the run (an epoch each): with workers and not persistent, each start
    # started its worker processes again.
    iterators: int
    # Seconds from the step before to the first batch of each epoch after the first (the iterator's start, its
    # workers' start among it, and the first batch's wait).
    first_batch_seconds: list[float] = []


class ScriptRun(Section):
    """``script``: a user's own script profiled from outside (``dtrain launch``, ``-m dtrain.profile``,
    ``DTRAIN_PROFILE``): what ran, where, how it exchanged and what could not be seen (one line each)."""

    OMITTED_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"loader", "host_syncs_per_step"})

    launcher: str  # "dtrain launch", "python -m dtrain.profile" or "DTRAIN_PROFILE"
    command: list[str]  # the script's path and arguments, as given
    cwd: str
    script: str  # absolute path
    script_sha256: str
    world_size: int
    ranks_reported: list[int]  # the ranks whose figures made it into the record
    complete: bool  # every rank reported after a normal end (False: a crash or a missing rank; partial figures)
    models: list[ScriptModel]
    loader: ScriptLoader | None = None
    # Per optimizer step: backward passes (micro-batches), and those that exchanged gradients (all-reduced).
    micro_batches_per_step: float
    exchanges_per_step: float
    no_sync: bool  # some backward ran under DDP's no_sync (accumulation without an exchange)
    grad_scaler: bool  # steps went through a GradScaler (a step it skipped still counts)
    optimizers: list[str]
    host_syncs_per_step: float | None = None  # synchronizing CUDA calls per step (None: not counted, not CUDA)
    unseen: list[str]  # what could not be seen, one line each
    # Where the script built its "loader", "optimizer" and "ddp" model, and called its first "backward": file:line.
    sites: dict[str, str] = {}
    # Changes made from outside for this run (dtrain doctor --verify's), as KEY=VALUE.
    overrides: list[str] = []
