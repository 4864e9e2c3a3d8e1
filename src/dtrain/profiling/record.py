"""``profile.json`` as a typed, versioned record: what a run's step profile holds, written and read here only.

The end of a run builds a :class:`ProfileRecord` (:func:`dtrain.profiling.figures.build_profile`) and rank 0
writes it with :func:`write_profile`; the doctor, ``dtrain plan``, ``--verify``, ``compare``, ``bench``, the
summary and the report read it back with :func:`load_profile` (a file) or :func:`load_run_profile` (a run's
directory) and use attributes, never string keys. The file is a user-facing contract (docs/profile.md):
field names are its keys, in its order, as ``json.dumps(..., indent=2)`` of the former dict gave. Sections a
run does not measure (``stragglers`` with one slot, the end-of-run probes, a device's own facts) are left out
of the file, not written as null; they are None here. Loading is strict: no coercion, no unknown keys, every
key the producer always writes is required. A file of another :data:`SCHEMA_VERSION`, damaged JSON or a
structure that does not validate is a :class:`ProfileError` in one line: what was found, and to re-run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_serializer

from dtrain.errors import UserError
from dtrain.profiling.phases import PHASES

# Raise it with any change of a key's name, type or meaning; the loader refuses every other version.
SCHEMA_VERSION = 1
FILE_NAME = "profile.json"

T = TypeVar("T")


class ProfileError(UserError):
    """``profile.json`` is missing, damaged, of another schema version, or has nothing profiled."""


class _Section(BaseModel):
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


class ByPhase(_Section, Generic[T]):
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


class Spread(_Section):
    """Seconds per step across ranks: a straggler shows as a wide min-max."""

    min: float
    mean: float
    max: float


# One rank's seconds per step by phase; the spread of each across ranks.
PhaseSeconds = ByPhase[float]
PhaseSpread = ByPhase[Spread]


class WorkSeconds(_Section):
    """Seconds per step of each work phase (every phase but ``comm_exposed``, the waiting itself)."""

    data: float
    forward: float
    backward: float
    optimizer: float
    other: float


class RankFigures(_Section):
    """``per_rank[i]``: one rank's means."""

    rank: int
    host: str
    seconds_per_step: PhaseSeconds
    comm_busy_seconds_per_step: float
    comm_bytes_per_step: float
    comm_buckets_per_step: float
    peak_memory_bytes: float
    state_bytes: float


class Comm(_Section):
    """``comm``: the gradient exchange, means over ranks (zeros with one slot)."""

    bytes_per_step: float
    buckets_per_step: float
    busy_seconds_per_step: float
    exposed_seconds_per_step: float
    algbw_bytes_per_second: float
    busbw_bytes_per_second: float
    latency_seconds: float


class RankLag(_Section):
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


class Stragglers(_Section):
    """``stragglers`` (2+ slots): arrival lags per rank and the chronically late rank, if any."""

    samples: int
    lag_floor_seconds: float
    chronic_last_fraction: float
    chronic_rank: int | None
    per_rank: list[RankLag]


class MatmulTflops(_Section):
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


class DeviceFacts(_Section):
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


class LrHyperparameter(_Section):
    """The ``lr``/``learning_rate`` hyperparameter, as the config gave it (an int stays an int)."""

    name: str
    value: int | float


class BatchScaling(_Section):
    """``batch_scaling``: the end-of-run probe at the per-slot batch and twice it, and one optimizer step, every
    rank at once; means over ranks. ``optimizer_seconds`` is 0 in files of an older dtrain."""

    per_slot_batch_size: int
    work_seconds: float
    work_double_seconds: float
    load_seconds: float
    load_double_seconds: float
    optimizer_seconds: float = 0.0


class AllreduceProbe(_Section):
    """``allreduce_probe`` (read, no longer written: ``comm_probe`` replaced it): one all-reduce size."""

    bytes: float
    seconds: float


class WorkPoint(_Section):
    """The trial's forward and backward at one thread count, at the per-slot batch and twice it; one optimizer
    step (0 in files of an older dtrain)."""

    threads: int
    work_seconds: float
    work_double_seconds: float
    optimizer_seconds: float = 0.0


class SoloProbe(_Section):
    """``solo_probe``: the first rank alone (the others idle) at the run's thread count, one and every core:
    what a slot does with the cores to itself, at other thread counts (CPU runs)."""

    per_slot_batch_size: int
    points: list[WorkPoint]


class CommPoint(_Section):
    """One all-reduce size of :class:`CommProbe`: bytes and median seconds."""

    bytes: float
    seconds: float


class CommProbe(_Section):
    """``comm_probe``: back-to-back all-reduces of several sizes among the run's ranks, on its backend."""

    world: int
    backend: str
    points: list[CommPoint]


class CompressionCost(_Section):
    """``compression_cost``: seconds per exchange of compressing this model's gradients (fp16 casts;
    PowerSGD's matmuls and QR at ``powersgd_rank``) and the bytes PowerSGD sends instead of all of them."""

    fp16_seconds: float
    powersgd_seconds: float
    powersgd_bytes: float
    powersgd_rank: int


MODEL_STEPS_VERSION = 1


class ModelSteps(_Section):
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


class MembershipChange(_Section):
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


class FirstSteps(_Section):
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


class Flops(_Section):
    """``flops`` (dtrain.profiling.flops): FLOPs per step per slot over the measured matmul peak (MFU)."""
    flops_per_step: float
    flops_per_step_all_slots: float
    peak_flops_per_second: float
    peak: str
    mfu_per_slot: list[float]
    mfu: float


class ProfileRecord(_Section):
    """The whole of ``profile.json`` (docs/profile.md): run facts, per-phase spreads, per-rank figures,
    communication, and the sections only some runs measure (None: absent from the file)."""

    OMITTED_WHEN_NONE: ClassVar[frozenset[str]] = frozenset(
        {"device_facts", "stragglers", "batch_scaling", "allreduce_probe", "data_load_seconds_per_batch",
         "data_load_cpu_share", "solo_probe", "comm_probe", "compression_cost", "step_jitter_seconds",
         "step_window_seconds", "unobserved_phases", "membership_changes", "model_steps", "first_steps",
         "flops", "gradient_bytes", "data_handoff_seconds_per_batch", "data_handoff_cpu_seconds_per_batch"})

    schema_version: int = SCHEMA_VERSION
    # What the run was (also summary.json's head: dtrain.profiling.runsummary.RunHead).
    slots: int
    strategy: str
    backend: str
    device: str
    precision: str
    threads_per_slot: int
    cpu_cores: int
    memory_total_bytes: float
    optimizer: str | None
    lr_hyperparameter: LrHyperparameter | None
    global_batch_size: int
    per_slot_batch_size: int
    parameters: int
    synthetic_data: bool
    data_loader_workers: int
    aggregation_frequency: int
    effective_batch_size: int
    gradient_compression: str
    tensor_fusion_threshold_mb: float | None
    comm_measured: bool
    strategy_compressions: list[str]
    profiling: bool
    steps: int
    profiled_steps: int
    timed_steps: int
    samples_per_second: float
    samples_per_second_all_steps: float
    train_seconds: float
    validation_seconds: float
    checkpoint_seconds: float
    wall_seconds: float
    device_facts: DeviceFacts | None = None
    resumed_at_batch: int
    # Where the time went.
    phases: list[str]
    # Phases the trial never marked (its train_batch calls loss.backward() / opt.step() rather than
    # context.backward / context.step_optimizer): their time is in "other", and they read as zero. Absent
    # from the file when every phase was seen (and from profiles written before it existed).
    unobserved_phases: list[str] | None = None
    seconds_per_step: PhaseSpread
    per_rank: list[RankFigures]
    comm: Comm
    stragglers: Stragglers | None = None
    batch_scaling: BatchScaling | None = None
    allreduce_probe: AllreduceProbe | None = None
    data_load_seconds_per_batch: float | None = None
    data_load_cpu_share: float | None = None
    data_handoff_seconds_per_batch: float | None = None  # through one loader process (profiling/handoff.py)
    data_handoff_cpu_seconds_per_batch: float | None = None  # the training thread's, to receive one
    solo_probe: SoloProbe | None = None
    comm_probe: CommProbe | None = None
    compression_cost: CompressionCost | None = None
    # How steps vary: a step's standard deviation (mean over ranks); the first rank's mean step per 16 steps.
    step_jitter_seconds: float | None = None
    step_window_seconds: list[float] | None = None
    # An elastic job's membership changes, in order (absent where its members never changed).
    membership_changes: list[MembershipChange] | None = None
    model_steps: ModelSteps | None = None  # absent where not probed, and from older profiles
    first_steps: FirstSteps | None = None  # also summary.json's (RunHead), as flops: absent from older files
    flops: Flops | None = None
    # Each model's trainable tensors' gradient bytes, in backward's order: DDP's buckets at any cap (older: absent).
    gradient_bytes: list[list[int]] | None = None

    @field_validator("phases")
    @classmethod
    def _known_phases(cls, phases: list[str]) -> list[str]:
        # Readers look phases up by name in ByPhase: another phase set is another schema version.
        if tuple(phases) != PHASES:
            raise ValueError(f"expected {list(PHASES)}")
        return phases

    @field_validator("unobserved_phases")
    @classmethod
    def _known_unobserved(cls, phases: list[str] | None) -> list[str] | None:
        if phases is not None and not set(phases) <= set(PHASES) - {"data", "other"}:
            raise ValueError(f"expected phases among {list(PHASES[1:-1])}")
        return phases

    @property
    def phases_observed(self) -> bool:
        """Whether every phase of the step was marked (the doctor diagnoses only then)."""
        return not self.unobserved_phases

    @property
    def hosts(self) -> int:
        """Distinct host names among the ranks (at least 1)."""
        return len({r.host for r in self.per_rank}) or 1


def write_profile(path: Path, record: ProfileRecord) -> None:
    """Write ``record`` to ``path`` as ``profile.json`` (indented JSON, keys in the record's order)."""
    # json.dumps of the plain dump, as the file was always written: the same bytes for the same figures
    # (Python's float repr, NaN/Infinity kept, no trailing newline).
    path.write_text(json.dumps(record.model_dump(), indent=2))


def _corrupt(path: Path, why: str) -> ProfileError:
    return ProfileError(f"{path} is empty or corrupt ({why}); re-run the experiment to write a new one")


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def load_profile(path: Path) -> ProfileRecord:
    """Read and validate one ``profile.json``; anything else is a one-line :class:`ProfileError`."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path} does not exist; pass the profile.json of a finished run") from None
    except OSError as exc:
        raise ProfileError(f"{path} cannot be read ({exc.strerror}); check its permissions") from None
    except ValueError as exc:  # bad JSON, or bytes that are not UTF-8
        raise _corrupt(path, str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    if not isinstance(document, dict) or "schema_version" not in document:
        raise _corrupt(path, "not a profile: no schema_version")
    found = document["schema_version"]
    if found != SCHEMA_VERSION or isinstance(found, bool):
        raise ProfileError(f"{path} has schema_version {_short(found)}, this dtrain reads schema_version "
                           f"{SCHEMA_VERSION}; re-run the experiment with this dtrain to write a new one")
    try:
        return ProfileRecord.model_validate(document)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "profile"
        raise _corrupt(path, f"{where}: {err['msg']}") from None


def load_run_profile(run_dir: Path) -> ProfileRecord:
    """The profile of a finished run's directory, with profiled steps to speak of: what the doctor, ``dtrain
    plan``, ``--verify`` and the report read. Each way it can fail is one line (:class:`ProfileError`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ProfileError(f"{run_dir} is not a directory; pass a run directory made by 'dtrain run'")
    if not (run_dir / "config.yaml").is_file():
        raise ProfileError(f"{run_dir} is not a dtrain run (no config.yaml); pass a run directory made by "
                           "'dtrain run'")
    path = run_dir / FILE_NAME
    if not path.is_file():
        raise ProfileError(f"{run_dir} has no profile.json yet: the run has not finished (or ran with "
                           "profiling.enabled: false); wait for it to end or re-run with profiling on")
    record = load_profile(path)
    # The doctor's model divides by the step and sums the phases: it needs finite phases and a step.
    for rank in record.per_rank:
        for phase in record.phases:
            if not math.isfinite(rank.seconds_per_step.of(phase)):
                raise _corrupt(path, f"non-finite {phase}")
    if not record.per_rank or record.seconds_per_step.step.mean <= 0:
        raise _corrupt(path, "no profiled steps")
    return record
