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
from typing import Any, ClassVar

from pydantic import ValidationError, field_validator

from dtrain.errors import UserError
from dtrain.profiling.phases import PHASES
from dtrain.profiling.sections import (
    MODEL_STEPS_VERSION,
    AllreduceProbe,
    BatchScaling,
    ByPhase,
    Comm,
    CommPoint,
    CommProbe,
    CompressionCost,
    DeviceFacts,
    FirstSteps,
    Flops,
    LrHyperparameter,
    MatmulTflops,
    MembershipChange,
    ModelSteps,
    PhaseSeconds,
    PhaseSpread,
    ProbeSkip,
    RankFigures,
    RankLag,
    ScriptLoader,
    ScriptModel,
    ScriptRun,
    Section,
    ShardedExchange,
    SoloProbe,
    Spread,
    Stragglers,
    WorkPoint,
    WorkSeconds,
)

# Raise it with any change of a key's name, type or meaning; the loader refuses every other version.
SCHEMA_VERSION = 1
FILE_NAME = "profile.json"
# How replicas talk: the values of ``exchange`` (dtrain.sync.base.SyncStrategy.exchange), read by the probes and
# the cost model, which prices ALL_REDUCE from a link, holds SERVER's exchange as measured per update, and takes
# SHARDED's collectives out of forward and backward where its end-of-run probe ran.
ALL_REDUCE = "all_reduce"  # gradients (or local SGD's parameters) all-reduced among the slots
SERVER = "server"  # pushed to and pulled from server ranks
SHARDED = "sharded"  # all-gathers and reduce-scatters inside forward and backward (FSDP)

# The sections are re-exported: readers import every part of the record from here.
__all__ = [
    "ALL_REDUCE", "FILE_NAME", "MODEL_STEPS_VERSION", "SCHEMA_VERSION", "SERVER", "SHARDED", "AllreduceProbe",
    "BatchScaling", "ByPhase", "Comm",
    "CommPoint", "CommProbe", "CompressionCost", "DeviceFacts", "FirstSteps", "Flops", "LrHyperparameter",
    "MatmulTflops", "MembershipChange", "ModelSteps", "PhaseSeconds", "PhaseSpread", "ProbeSkip", "ProfileError",
    "ProfileRecord", "RankFigures", "RankLag", "ScriptLoader", "ScriptModel", "ScriptRun", "Section",
    "ShardedExchange", "SoloProbe", "Spread", "Stragglers",
    "WorkPoint", "WorkSeconds", "load_profile", "load_run_profile", "write_profile",
]


class ProfileError(UserError):
    """``profile.json`` is missing, damaged, of another schema version, or has nothing profiled."""


class ProfileRecord(Section):
    """The whole of ``profile.json`` (docs/profile.md): run facts, per-phase spreads, per-rank figures,
    communication, and the sections only some runs measure (None: absent from the file)."""

    OMITTED_WHEN_NONE: ClassVar[frozenset[str]] = frozenset(
        {"device_facts", "stragglers", "batch_scaling", "allreduce_probe", "data_load_seconds_per_batch",
         "data_load_cpu_share", "solo_probe", "comm_probe", "compression_cost", "step_jitter_seconds",
         "step_window_seconds", "unobserved_phases", "membership_changes", "model_steps", "first_steps",
         "flops", "gradient_bytes", "data_handoff_seconds_per_batch", "data_handoff_cpu_seconds_per_batch", "exchange",
         "sharded_exchange", "data_crowded_none_step_seconds", "probes_skipped",
         "script"})

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
    # How replicas talk (dtrain.sync.base.SyncStrategy.exchange); None: a file from before it was recorded.
    exchange: str | None = None
    strategy_compressions: list[str]
    profiling: bool
    # The end-of-run probes ran (profiling.probes); False: the run turned them off, and no change is priced.
    probes: bool = True
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
    # A step with 1, 2, ... loader processes per slot (item W - 1): the run's own steps timed after it (CPU hosts)
    data_crowded_step_seconds: list[float] | None = None
    # The same probe's step with the run's own loader processes (data_loader_workers): the others' scale
    data_crowded_own_step_seconds: float | None = None
    # The same probe's step with no loader process (each batch loaded in place), where the run had some
    data_crowded_none_step_seconds: float | None = None
    solo_probe: SoloProbe | None = None
    comm_probe: CommProbe | None = None
    compression_cost: CompressionCost | None = None
    sharded_exchange: ShardedExchange | None = None  # FSDP: forward and backward with and without collectives
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
    # The end-of-run probes' wall time on the first rank: what they added to the run (None: not probed).
    probe_seconds: float | None = None
    # A user's own script profiled from outside (dtrain launch SCRIPT): what ran and what could not be seen.
    script: ScriptRun | None = None
    # The end-of-run probes every rank skipped, and why ([]: none; None: not probed, and files before 2026-12-07).
    probes_skipped: list[ProbeSkip] | None = None

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
    # A script's run (dtrain launch SCRIPT) has no config.yaml: its profile.json says what ran.
    if not (run_dir / "config.yaml").is_file() and not (run_dir / FILE_NAME).is_file():
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
