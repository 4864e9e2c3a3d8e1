"""The experiment config's pydantic models: the schema of the YAML, section by section, the checks of
single values, and a validation error worded as one line.

The bottom of config loading, which goes one way: :mod:`.safeyaml` reads the file, :mod:`.determined`
translates Determined's keys (its did-you-mean knows these fields), these models validate, and
:mod:`.schema` ties the three together (``load_config``). The YAML vocabulary follows Determined's experiment
config; ``global_batch_size`` lives in ``hyperparameters``, as in Determined.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from dtrain.config import safeyaml
from dtrain.config.bounds import (
    MAX_BATCHES,
    MAX_EPOCHS,
    MAX_FUSION_MB,
    MAX_GLOBAL_BATCH,
    MAX_LOADER_WORKERS,
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    MAX_SEED,
    MAX_SLOTS,
    MAX_STEPS,
    MAX_TIMEOUT_SECONDS,
    Strict,
)
from dtrain.errors import ConfigError
from dtrain.sync.options import DEFAULT_FUSION_MB, LocalSGDOptions, ParameterServerOptions, PowerSGDOptions


class Length(Strict):
    """A training length or period: exactly one of ``batches`` or ``epochs`` (a Determined config's
    ``records`` are batches by the time the schema sees them: :mod:`dtrain.config.determined`)."""

    batches: int | None = Field(default=None, ge=1, le=MAX_BATCHES)
    epochs: int | None = Field(default=None, ge=1, le=MAX_EPOCHS)

    @model_validator(mode="after")
    def _exactly_one(self) -> Length:
        if (self.batches is None) == (self.epochs is None):
            raise ValueError("give exactly one of 'batches' or 'epochs', e.g. {batches: 100}")
        return self

    def to_batches(self, batches_per_epoch: int) -> int:
        """Length in global batches, given how many global batches one epoch holds."""
        return self.batches if self.batches is not None else self.epochs * batches_per_epoch  # type: ignore[operator]


class Resources(Strict):
    slots_per_trial: int = Field(default=1, ge=1, le=MAX_SLOTS)
    # Multi-machine runs: the interface Gloo/NCCL use (None = auto-detect one common to all nodes), and
    # how long to wait for every node to join before failing with the names of the missing ones.
    network_interface: str | None = None
    join_timeout_seconds: float = Field(default=300.0, ge=1, le=MAX_TIMEOUT_SECONDS, allow_inf_nan=False)
    # An elastic job (--nnodes MIN:MAX): how long a rendezvous that has its minimum of nodes, but not its
    # maximum, waits for more before it starts (torch's last_call_timeout, whole seconds). Longer gathers
    # nodes that start at different times into the first world; shorter starts, and goes on after a leave,
    # sooner. A lost node's survivors wait 2 s (dtrain.launcher.elastic).
    rendezvous_last_call_seconds: int = Field(default=5, ge=1, le=3600)
    # Collective timeout: torch's default is 30 minutes, far too long to notice a stuck peer.
    collective_timeout_seconds: float = Field(default=300.0, ge=1, le=MAX_TIMEOUT_SECONDS, allow_inf_nan=False)

    @field_validator("network_interface")
    @classmethod
    def _interface_name(cls, value: str | None) -> str | None:
        # Linux interface names: at most 15 bytes, no '/' or white space (IFNAMSIZ, dev_valid_name).
        if value is not None and not (0 < len(value.encode()) <= 15 and value.isprintable()
                                      and "/" not in value and not any(c.isspace() for c in value)):
            raise ValueError(f"expected an interface name such as 'eth0' (1 to 15 characters, "
                             f"no '/' or spaces), got {safeyaml.show(value)}")
        return value
    # On SIGTERM/SIGINT (a preemption: Kubernetes and Slurm send SIGTERM first), how long the ranks get to
    # finish their step and write a checkpoint before they are killed. Keep it under the scheduler's own
    # grace (Kubernetes' terminationGracePeriodSeconds defaults to 30 s, Slurm's GraceTime to 0).
    preemption_grace_seconds: float = Field(default=25.0, gt=0, le=3600, allow_inf_nan=False)


class CheckpointStorage(Strict):
    # Relative paths are resolved against the run directory and may not leave it; an absolute path is the
    # user's explicit choice (checked writable before any worker starts).
    path: str = Field(default="checkpoints", min_length=1, max_length=MAX_PATH_CHARS)
    save_trial_latest: int = Field(default=2, ge=1, le=10_000)

    @field_validator("path")
    @classmethod
    def _inside_run_dir(cls, value: str) -> str:
        return check_storage_path(value)


class DataLoaderOptions(Strict):
    """How dtrain feeds each slot (the trial only returns Datasets)."""

    # Background loader processes per slot; 0 loads in the training process.
    # Bounded again by this machine's cores before workers start (preflight.check_machine).
    num_workers: int = Field(default=0, ge=0, le=MAX_LOADER_WORKERS)
    # Reuse one real batch per slot, kept on the device, for every step: data loading drops out of the
    # step time, which isolates I/O cost when checking scaling (as Determined advises).
    synthetic: bool = False


class Profiling(Strict):
    """The step profiler: on by default, as its cost is within measurement noise (docs/benchmarks.md, "Profiler
    overhead")."""

    enabled: bool = True
    # First steps carry one-off costs (DDP's bucket rebuild, allocator warm-up): timed, not profiled.
    warmup_steps: int = Field(default=3, ge=0, le=MAX_STEPS)
    # After 200 profiled steps, time one step in this many (random, the same on every rank; each weighs as
    # many steps in the figures). 1 times every step.
    sample_every: int = Field(default=4, ge=1, le=1_000_000)
    # After training, time the model's own steps at other batch sizes, threads and precisions, and the
    # all-reduce at other sizes (dtrain.profiling.probes): what the doctor and `dtrain plan` price changes by.
    # Off: the run ends sooner (up to seconds per run, more for a big model), and they price no change.
    probes: bool = True


class Optimizations(Strict):
    """Determined's ``optimizations`` section, with its defaults."""

    # k batches per optimizer update; gradients are exchanged once per k batches.
    aggregation_frequency: int = Field(default=1, ge=1, le=10_000)
    average_aggregated_gradients: bool = True
    average_training_metrics: bool = True
    gradient_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd: PowerSGDOptions = Field(default_factory=PowerSGDOptions)
    # MB per gradient all-reduce message (DDP bucket size).
    tensor_fusion_threshold: float = Field(default=DEFAULT_FUSION_MB, ge=0, le=MAX_FUSION_MB, allow_inf_nan=False)
    auto_tune_tensor_fusion: bool = False
    # Candidates the auto-tuner measures (MB), and how: warm-up steps then measured steps, each.
    auto_tune_candidates_mb: list[Annotated[float, Field(le=MAX_FUSION_MB, allow_inf_nan=False)]] = Field(
        default_factory=lambda: [1.0, 4.0, 16.0, 64.0], max_length=64)
    auto_tune_warmup_steps: int = Field(default=2, ge=0, le=10_000)
    auto_tune_steps_per_candidate: int = Field(default=5, ge=1, le=10_000)
    # A nan/inf loss or gradient: fail (stop, naming the first rank and batch; no checkpoint with non-finite
    # weights is written), or skip that update on every rank, failing after max_nonfinite_skips in a row.
    on_nonfinite: Literal["fail", "skip"] = "fail"
    max_nonfinite_skips: int = Field(default=10, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _check_candidates(self) -> Optimizations:
        if not self.auto_tune_candidates_mb or any(c < 0 for c in self.auto_tune_candidates_mb):
            raise ValueError(f"auto_tune_candidates_mb must be a non-empty list of sizes >= 0 (MB), "
                             f"got {self.auto_tune_candidates_mb}")
        return self


class SyncOptions(Strict):
    """How replicas are kept in sync: a strategy registered in :mod:`dtrain.sync.registry` (built-ins:
    ddp, allreduce, parameter_server, local_sgd, fsdp), and the options of those that have some."""

    strategy: str = "ddp"
    local_sgd: LocalSGDOptions = Field(default_factory=LocalSGDOptions)
    parameter_server: ParameterServerOptions = Field(default_factory=ParameterServerOptions)

    @field_validator("strategy")
    @classmethod
    def _registered(cls, name: str) -> str:
        from dtrain.sync import registry  # imports torch: only when a config is validated

        try:
            registry.lookup(name)
        except KeyError:
            raise ValueError(f"got {name!r}; expected one of {', '.join(map(repr, registry.names()))}") from None
        return name


# The `type`s of a hyperparameter range (Determined's names); `dtrain search` samples them.
HPARAM_TYPES = ("const", "int", "double", "log", "categorical")


class SearcherConfig(Strict):
    """Determined's ``searcher`` section: how ``dtrain search`` picks, stops and ranks trials.

    ``dtrain run`` ignores it; the search logic lives in :mod:`dtrain.search`.
    """

    name: Literal["single", "grid", "random", "adaptive_asha"] = "single"
    # A validation metric the trial reports (a key of its evaluate_batch dict).
    metric: str
    smaller_is_better: bool = True
    # Trials to sample (random, adaptive_asha); grid runs every point of its grid (at most max_trials if given).
    max_trials: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    # Training length of one trial (ASHA: of a trial that reaches the top rung); default: max_length.
    max_length: Length | None = None
    # 0: as many trials at once as the search's slots hold.
    max_concurrent_trials: int = Field(default=0, ge=0)
    # ASHA: keep the best 1/divisor at each rung; rung lengths are max_length / divisor^k.
    divisor: int = Field(default=4, ge=2, le=1024)
    max_rungs: int = Field(default=5, ge=1)
    # ASHA's brackets, as Determined's: aggressive runs one (max_rungs rungs), standard and conservative also
    # run brackets of fewer rungs, each with its share of max_trials (dtrain.config.rungs). Determined's
    # default is standard; dtrain's is one bracket (the plan's note says so).
    mode: Literal["aggressive", "standard", "conservative"] | None = None
    # Rungs per bracket, given explicitly (instead of mode), as Determined's bracket_rungs.
    bracket_rungs: list[Annotated[int, Field(ge=1, le=64)]] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _check_trials(self) -> SearcherConfig:
        if self.name in ("random", "adaptive_asha") and self.max_trials is None:
            raise ValueError(f"searcher.max_trials is required with searcher.name {self.name}: how many trials "
                             "to sample, e.g. max_trials: 16")
        return self


def first_range(hparams: dict[str, Any], prefix: str = "") -> str | None:
    """The dotted name of the first hyperparameter given as a search range (``{type: ...}``), or None."""
    for key, value in hparams.items():
        if isinstance(value, dict):
            if value.get("type") in HPARAM_TYPES:
                return f"{prefix}{key}"
            found = first_range(value, f"{prefix}{key}.")
            if found is not None:
                return found
    return None


class ExperimentConfig(Strict):
    """A whole experiment. Field names and meanings follow Determined where it has one."""

    name: str = Field(default="experiment", min_length=1)
    entrypoint: str = Field(min_length=3, max_length=256)
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    resources: Resources = Field(default_factory=Resources)
    max_length: Length
    min_validation_period: Length | None = None
    min_checkpoint_period: Length | None = None
    # How often (in batches) training metrics are reduced and reported.
    scheduling_unit: int = Field(default=100, ge=1, le=MAX_STEPS)
    checkpoint_storage: CheckpointStorage = Field(default_factory=CheckpointStorage)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # Lightning's vocabulary: 32-true, tf32 (CUDA matmuls on TF32 tensor cores), bf16-mixed, 16-mixed
    # (autocast around the model's forward; 16-mixed adds loss scaling and needs CUDA).
    precision: Literal["32-true", "tf32", "bf16-mixed", "16-mixed"] = "32-true"
    max_restarts: int = Field(default=0, ge=0, le=100)
    # Below 2**63: torch, numpy and the samplers add the rank and the epoch to it.
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    optimizations: Optimizations = Field(default_factory=Optimizations)
    data_loader: DataLoaderOptions = Field(default_factory=DataLoaderOptions)
    profiling: Profiling = Field(default_factory=Profiling)
    sync: SyncOptions = Field(default_factory=SyncOptions)
    searcher: SearcherConfig | None = None
    # Determined's `data`: free-form settings for loading the data, read with context.get_data_config().
    data: dict[str, Any] = Field(default_factory=dict)
    # Folder the entrypoint module is imported from; set from the config file's location.
    code_dir: str = Field(default=".", min_length=1, max_length=4096)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return check_name(value)

    @field_validator("code_dir")
    @classmethod
    def _code_dir_is_a_path(cls, value: str) -> str:
        if not value.isprintable():
            raise ValueError(f"{safeyaml.show(value)} holds control characters; give a folder path")
        return value

    @field_validator("entrypoint")
    @classmethod
    def _importable_names(cls, value: str) -> str:
        module, _, trial = value.partition(":")
        if not (trial.isidentifier() and all(part.isidentifier() for part in module.split("."))):
            raise ValueError(f"expected 'module:TrialClass' (Python names), e.g. 'model_def:DigitsTrial', "
                             f"got {safeyaml.show(value)}")
        return value

    @field_validator("data")
    @classmethod
    def _plain_data(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_plain(value, "data")
        return value

    @field_validator("hyperparameters")
    @classmethod
    def _plain_hyperparameters(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_plain(value, "hyperparameters")
        gbs = value.get("global_batch_size")
        if isinstance(gbs, int) and not isinstance(gbs, bool) and gbs > MAX_GLOBAL_BATCH:
            raise ValueError(f"hyperparameters.global_batch_size must be at most {MAX_GLOBAL_BATCH:,}, got {gbs:,}")
        return value

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        if ":" not in self.entrypoint or not all(self.entrypoint.split(":", 1)):
            raise ValueError(f"expected 'module:TrialClass', e.g. 'model_def:DigitsTrial', got {self.entrypoint!r}")
        ranged = first_range(self.hyperparameters)
        if ranged is not None:  # dtrain search hands each trial single values
            raise ValueError(f"hyperparameters.{ranged} is a search range; use dtrain search, or give a single value")
        gbs = self.hyperparameters.get("global_batch_size")
        if gbs is None:
            raise ValueError("hyperparameters.global_batch_size is required (an integer >= 1)")
        if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
            raise ValueError(f"hyperparameters.global_batch_size must be an integer >= 1, got {gbs!r}")
        from dtrain.sync import registry

        registry.lookup(self.sync.strategy).check_config(self)  # what the strategy cannot honour
        return self

    @property
    def global_batch_size(self) -> int:
        return int(self.hyperparameters["global_batch_size"])



def check_name(value: str) -> str:
    """An experiment name becomes a folder name (``runs/<name>-<time>``): letters, digits, ``_.-`` only,
    so that it can neither leave ``runs/`` nor break the file system's limits."""
    if (len(value) > MAX_NAME_CHARS or len(value.encode()) > 2 * MAX_NAME_CHARS
            or not all(c.isalnum() or c in "_.-" for c in value) or value[0] in ".-"):
        raise ValueError(f"must be 1 to {MAX_NAME_CHARS} letters, digits, '_', '.' or '-' (not starting with "
                         f"'.' or '-'), got {safeyaml.show(value)}; it names the run directory")
    return value


def check_storage_path(value: str) -> str:
    """A relative checkpoint path must stay inside the run directory; any path must be a sane file name."""
    if not value.isprintable():
        raise ValueError(f"{safeyaml.show(value)} holds control characters; "
                         "use a plain folder name")
    parts = PurePosixPath(value).parts
    if any(len(part.encode()) > 255 for part in parts):
        raise ValueError(f"{safeyaml.show(value)} has a component over 255 bytes; "
                         "use shorter folder names")
    if not PurePosixPath(value).is_absolute() and ".." in parts:
        raise ValueError(f"{safeyaml.show(value)} leaves the run directory ('..'); use a "
                         "folder inside it, e.g. 'checkpoints', or an absolute path you choose")
    return value


def check_plain(value: Any, where: str) -> None:
    """Hyperparameters reach the trial, ``config.yaml`` and JSON reports: JSON-like values only, finite
    numbers, string keys (the YAML reader already bounded the size and depth)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} is {value}; use a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where} has the key {safeyaml.show(key)} ({type(key).__name__}); keys must be "
                                 "strings: quote it")
            check_plain(item, f"{where}.{safeyaml.plain(key, 60)}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
    elif value is not None and not isinstance(value, (str, int, float)):
        raise ValueError(f"{where} is a {type(value).__name__}; use strings, numbers, lists and mappings")


def reject_unknown_keys(data: Any, model: type[BaseModel], prefix: str, source: str) -> None:
    """Unknown keys are errors with a did-you-mean (pydantic alone gives no suggestion)."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key)[:100], list(fields), n=1, cutoff=0.6)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys here: {', '.join(fields)}"
            raise ConfigError(f"{source}: unknown key '{safeyaml.plain(path, 120)}'; {hint}")
        sub = _submodel(fields[key].annotation)
        if sub is not None:
            reject_unknown_keys(value, sub, prefix=f"{path}.", source=source)


def _submodel(annotation: Any) -> type[BaseModel] | None:
    candidates = getattr(annotation, "__args__", None) or (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def describe_error(exc: ValidationError, source: str) -> str:
    """One line: the full field path, the value received (cut short), what was expected."""
    err = exc.errors()[0]
    loc = ".".join(safeyaml.plain(str(p), 60) for p in err["loc"])
    msg = safeyaml.plain(err["msg"].removeprefix("Value error, "), 400)
    if err["type"] == "missing":
        return f"{source}: required key '{loc}' is missing; add it to the config"
    expected = expected_phrase(msg)
    received = err.get("input")
    if isinstance(received, dict) or err["type"].startswith("value_error"):
        return f"{source}: {loc + ': ' if loc else ''}{msg}"
    return (f"{source}: {loc}: got {safeyaml.show(received)} ({type(received).__name__}); expected {expected}"
            f"; fix it in the config or with --set {loc}=...")


def expected_phrase(message: str) -> str:
    """What a pydantic message says was expected, as the end of "expected ...": "a valid integer"."""
    expected = re.sub(r"^(Input should be |(String|List|Dictionary) should have )", "", message)
    return f"a value {expected}" if expected.startswith(("greater", "less")) else expected


def samples_only_sets(config: ExperimentConfig) -> list[str]:
    """``--set`` items for a run read for its samples/s alone (a search trial, a ``dtrain bench`` or ``dtrain
    compare`` case): the end-of-run probes off, as they would only lengthen it, unless the config (or the
    command's ``--set``) names ``profiling.probes``: then it keeps its choice."""
    return [] if "probes" in config.profiling.model_fields_set else ["profiling.probes=false"]
