"""Determined experiment configs, read as they are.

A Determined user's experiment YAML (Determined's open-source releases ended in 2025) runs under
``dtrain run``, ``dtrain check`` and ``dtrain search`` without edits. :func:`translate` turns such a mapping
into dtrain's own vocabulary before the schema sees it:

* what dtrain has under another name or unit is mapped: a length in ``records`` becomes batches exactly as
  Determined's PyTorch trainer converted it (``max(records // global_batch_size, 1)``), a period of 0 means
  "never", ``searcher.max_length`` (or ``time_metric``/``max_time``) gives the trial's length when the
  top-level ``max_length`` is absent, ``reproducibility.experiment_seed`` is the ``seed``, a ``const``
  hyperparameter is its value, the ``--trial`` of a launch-module entrypoint is the Trial class;
* what only means something to a Determined master or cluster (metadata, containers, scheduling, storage
  back ends) is dropped and named, all of it in one warning line;
* what dtrain cannot honour (a script entrypoint, a checkpoint UUID to start from, apex's O2) is refused
  in one line naming the key and the fix;
* everything else, dtrain's own keys included, is left alone: misspellings stay errors with a did-you-mean.

A mapping already in dtrain's form (a run's ``config.yaml``) comes back unchanged and without a warning.
The key-by-key table is ``docs/from-determined-config.md``; :data:`IGNORED` holds the reasons it states.
"""

from __future__ import annotations

import copy
import difflib
import logging
import shlex
from dataclasses import dataclass, field
from typing import Any

from dtrain.config import safeyaml
from dtrain.config.bounds import MAX_BATCHES
from dtrain.config.model import CheckpointStorage, ExperimentConfig, Optimizations, Profiling, Resources, SearcherConfig
from dtrain.errors import ConfigError

log = logging.getLogger(__name__)

DOC = "docs/from-determined-config.md"

# Keys (dotted) that dtrain ignores, and why: each is named in the warning line when a config gives it.
IGNORED: dict[str, str] = {
    "description": "metadata of the Determined web UI",
    "labels": "metadata of the Determined web UI",
    "workspace": "where the Determined master files the experiment",
    "project": "where the Determined master files the experiment",
    "environment": "the trial container (image, environment variables, pod spec, ports): dtrain's workers run in "
                   "the environment dtrain is started in",
    "bind_mounts": "container mounts: dtrain's workers see this machine's file system",
    "debug": "the master's debug logging: use dtrain --debug",
    "internal": "Determined-internal settings",
    "security": "Kerberos on the cluster",
    "slurm": "sbatch options of Determined's Slurm launcher: dtrain slurm takes its own options",
    "pbs": "qsub options of Determined's PBS launcher",
    "log_policies": "patterns the master matches in trial logs",
    "retention_policy": "how long the master keeps trial logs",
    "log_retention_days": "how long the master keeps trial logs",
    "integrations": "Pachyderm and webhooks of the master",
    "tensorboard_storage": "where the master keeps TensorBoard files: dtrain writes them into the run directory",
    "data_layer": "the cluster's data-layer cache (removed from Determined in 0.17)",
    "preemption_timeout": "the master's wait for a preempted trial: dtrain's is resources.preemption_grace_seconds",
    "checkpoint_policy": "checkpoints after a validation that improved: dtrain checkpoints at "
                         "min_checkpoint_period, at rung ends and at the end",
    "perform_initial_validation": "a validation before the first batch: dtrain validates at min_validation_period "
                                  "and at the end",
    "records_per_epoch": "dtrain counts an epoch from the training data, as Determined's PyTorchTrial did",
    "resources.slots": "has no effect in Determined either",
    "resources.max_slots": "the experiment's share of the cluster",
    "resources.weight": "the experiment's share of the cluster",
    "resources.priority": "the cluster scheduler's priority",
    "resources.resource_pool": "the cluster's resource pool",
    "resources.agent_label": "which agents of the cluster may run the trial",
    "resources.devices": "devices passed to the trial container",
    "resources.is_single_node": "container placement on the cluster",
    "resources.native_parallel": "removed from Determined",
    "resources.shm_size": "/dev/shm of the trial container",
    "optimizations.tensor_fusion_cycle_time": "Horovod's fusion timer: DDP has none",
    "optimizations.grad_updates_size_file": "Horovod's auto-tuning log",
    "profiling.begin_on_batch": "the window of Determined's system-metrics profiler: dtrain's step profiler "
                                "has profiling.warmup_steps and profiling.sample_every",
    "profiling.end_after_batch": "the window of Determined's system-metrics profiler",
    "profiling.sync_timings": "Determined's profiler: dtrain times steps between device-synchronized points",
    "checkpoint_storage.save_experiment_best": "checkpoint garbage collection by the master: dtrain keeps the "
                                              "latest save_trial_latest checkpoints",
    "checkpoint_storage.save_trial_best": "checkpoint garbage collection by the master",
}
# checkpoint_storage's back ends: checkpoints stay in the run directory (checkpoint_storage.path).
STORAGE_TYPES = ("shared_fs", "directory", "s3", "gcs", "azure", "hdfs")
STORAGE_KEYS = ("type", "host_path", "storage_path", "container_path", "checkpoint_path", "tensorboard_path",
                "propagation", "bucket", "prefix", "access_key", "secret_key", "endpoint_url", "container",
                "connection_string", "account_url", "credential", "hdfs_url", "hdfs_path", "user")
for _key in STORAGE_KEYS:
    IGNORED[f"checkpoint_storage.{_key}"] = ("a back end of the Determined master's checkpoint store: dtrain "
                                             "writes checkpoints into the run directory (checkpoint_storage.path)")
# Keys dtrain maps (see translate); with IGNORED, every key of Determined's experiment schema.
MAPPED = {
    "entrypoint", "hyperparameters", "data", "max_restarts", "min_validation_period", "min_checkpoint_period",
    "scheduling_unit", "reproducibility", "reproducibility.experiment_seed", "resources.slots_per_trial",
    "optimizations.gradient_compression", "optimizations.mixed_precision", "searcher.time_metric",
    "searcher.max_time", "searcher.num_rungs", "searcher.stop_once", "searcher.source_trial_id",
    "searcher.source_checkpoint_uuid",
}
# Searchers Determined had that dtrain has not.
_GONE_SEARCHERS = {"adaptive": "removed in Determined 0.17", "adaptive_simple": "removed in Determined 0.17",
                   "sync_halving": "removed in Determined 0.17", "pbt": "population-based training",
                   "custom": "a searcher written against Determined's master API"}
_LAUNCHERS = ("determined.launch.torch_distributed", "determined.launch.horovod")
_LENGTH_UNITS = ("batches", "records", "epochs")
_ENTRYPOINT_CHARS = 1024


@dataclass
class Translation:
    """The config in dtrain's vocabulary, and the Determined keys that were dropped (dotted, in file order)."""

    raw: dict[str, Any]
    ignored: list[str] = field(default_factory=list)

    def warning(self, source: str) -> str | None:
        """The one warning line naming every ignored key, or None."""
        if not self.ignored:
            return None
        groups: dict[str, list[str]] = {}  # resources.{resource_pool,priority}: one entry per section
        for key in self.ignored:
            section, _, name = key.rpartition(".")
            groups.setdefault(section, []).append(name)
        names = [(f"{s}.{{{','.join(n)}}}" if len(n) > 1 else f"{s}.{n[0]}") if s else ", ".join(n)
                 for s, n in groups.items()]
        return (f"{safeyaml.plain(source)}: Determined settings without effect in dtrain, ignored: "
                f"{', '.join(names)} ({DOC} says why for each)")


def translate(raw: dict[str, Any], source: str, batch_hint: int | None = None) -> Translation:
    """``raw`` (as read from YAML) in dtrain's vocabulary; a value dtrain cannot honour raises
    :class:`ConfigError`. ``batch_hint``: the global batch size to convert records with when ``raw`` gives
    none (the file's own values where ``--set`` supplies the batch size)."""
    out = copy.deepcopy(raw)
    t = Translation(out)
    where = safeyaml.plain(source)
    _suggest(out, set(ExperimentConfig.model_fields) | _top_level(), "", where)
    for key in list(out):
        if key in IGNORED:
            del out[key]
            t.ignored.append(key)
    _seed(out, where)
    _entrypoint(out, where)
    hparams = out.get("hyperparameters")
    if isinstance(hparams, dict):
        out["hyperparameters"] = _resolve_consts(hparams)
    _sections(out, t, where)
    gbs = _global_batch(out.get("hyperparameters"), batch_hint)
    searcher = out.get("searcher")
    if isinstance(searcher, dict):
        _searcher(searcher, where)
        _length(searcher, "max_length", gbs, where, "searcher.")
    for key in ("max_length", "min_validation_period", "min_checkpoint_period"):
        _length(out, key, gbs, where, "", period=key != "max_length")
    if out.get("max_length") is None and isinstance(searcher, dict) and isinstance(searcher.get("max_length"), dict):
        # Determined kept a trial's length in the searcher (single/random/grid: the trial's length;
        # adaptive_asha: the length of a trial that reaches the top rung).
        out["max_length"] = copy.deepcopy(searcher["max_length"])
    return t


# ------------------------------------------------------------------------------------------- sections


def _top_level() -> set[str]:
    return {k for k in (*IGNORED, *MAPPED) if "." not in k}


def _suggest(node: dict[str, Any], known: set[str], prefix: str, where: str) -> None:
    """A key known to neither dtrain nor Determined but close to a Determined one: did-you-mean that one
    (dtrain's own did-you-mean, after translation, only knows dtrain's keys)."""
    for key in node:
        if not isinstance(key, str) or key in known:
            continue
        close = difflib.get_close_matches(key[:100], sorted(known), n=1, cutoff=0.75)
        if close:
            raise ConfigError(f"{where}: unknown key '{safeyaml.plain(prefix + key, 120)}'; did you mean "
                              f"'{prefix}{close[0]}'?")


def _sections(out: dict[str, Any], t: Translation, where: str) -> None:
    """The sections dtrain shares with Determined: drop their cluster-only keys, map the others."""
    for name, model in (("resources", Resources), ("optimizations", Optimizations), ("profiling", Profiling),
                        ("checkpoint_storage", CheckpointStorage)):
        section = out.get(name)
        if not isinstance(section, dict):
            continue
        ours = {k.split(".", 1)[1] for k in (*IGNORED, *MAPPED) if k.startswith(f"{name}.")}
        _suggest(section, set(model.model_fields) | ours, f"{name}.", where)
        if name == "checkpoint_storage":
            _storage(section, where)
        for key in list(section):
            if f"{name}.{key}" in IGNORED:
                del section[key]
                t.ignored.append(f"{name}.{key}")
    resources = out.get("resources")
    if isinstance(resources, dict) and resources.get("slots_per_trial") == 0 and not isinstance(
            resources["slots_per_trial"], bool):
        # Determined's CPU-only trial: one process, no GPU. dtrain counts CPU processes as slots.
        resources["slots_per_trial"] = 1
        backend = out.setdefault("backend", "gloo")
        if backend == "nccl":
            raise ConfigError(f"{where}: resources.slots_per_trial 0 asks for a trial without GPUs but backend is "
                              "nccl; give slots_per_trial 1 or more, or backend gloo")
    optimizations = out.get("optimizations")
    if isinstance(optimizations, dict):
        _optimizations(out, optimizations, where)


def _storage(section: dict[str, Any], where: str) -> None:
    kind = section.get("type")
    if "type" in section and kind not in STORAGE_TYPES:
        raise ConfigError(f"{where}: checkpoint_storage.type: got {safeyaml.show(kind)}; Determined's types are "
                          f"{', '.join(STORAGE_TYPES)} (all ignored: dtrain writes checkpoints into the run "
                          "directory); drop it, or give checkpoint_storage.path")
    latest = section.get("save_trial_latest")
    if latest == 0 and not isinstance(latest, bool):
        # Determined could keep none of the latest (only the best); dtrain resumes from the latest one.
        section["save_trial_latest"] = 1


def _optimizations(out: dict[str, Any], section: dict[str, Any], where: str) -> None:
    compression = section.get("gradient_compression")
    if isinstance(compression, bool):  # Determined's Horovod compression: fp16
        section["gradient_compression"] = "fp16" if compression else "none"
    if "mixed_precision" not in section:
        return
    amp = section.pop("mixed_precision")
    if amp in (None, "O0"):
        return
    if amp != "O1":
        raise ConfigError(f"{where}: optimizations.mixed_precision: got {safeyaml.show(amp)}; dtrain has apex's O1 "
                          "(autocast with loss scaling: precision 16-mixed) but not O2/O3 (fp16 weights); use "
                          "precision: 16-mixed or bf16-mixed")
    if out.get("precision", "16-mixed") != "16-mixed":
        raise ConfigError(f"{where}: optimizations.mixed_precision O1 is precision 16-mixed, but precision is "
                          f"{safeyaml.show(out['precision'])}; keep one of the two")
    out["precision"] = "16-mixed"


def _seed(out: dict[str, Any], where: str) -> None:
    if "reproducibility" not in out:
        return
    section = out.pop("reproducibility")
    if section is None:
        return
    if not isinstance(section, dict) or set(section) - {"experiment_seed"}:
        raise ConfigError(f"{where}: reproducibility: expected a mapping with experiment_seed only, e.g. "
                          "{experiment_seed: 42}; got " + safeyaml.show(section))
    seed = section.get("experiment_seed")
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"{where}: reproducibility.experiment_seed: got {safeyaml.show(seed)} "
                          f"({type(seed).__name__}); expected an integer >= 0")
    if out.setdefault("seed", seed) != seed:
        raise ConfigError(f"{where}: reproducibility.experiment_seed {seed} and seed {safeyaml.show(out['seed'])} "
                          "disagree; keep one of the two")


def _entrypoint(out: dict[str, Any], where: str) -> None:
    """``python3 -m determined.launch.torch_distributed --trial model_def:Trial`` runs ``model_def:Trial`` on
    dtrain's own launcher; a script (Determined's Core API) is no Trial class, so it is refused."""
    value = out.get("entrypoint")
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        value = out["entrypoint"] = " ".join(value)  # Determined's list form: the words of one command
    if not isinstance(value, str) or not any(c.isspace() for c in value.strip()):
        return
    if len(value) > _ENTRYPOINT_CHARS:
        return  # the schema refuses it by length
    try:
        words = shlex.split(value)
    except ValueError:
        words = value.split()
    trial = next((w.split("=", 1)[1] for w in words if w.startswith("--trial=")), None)
    if trial is None and "--trial" in words[:-1]:
        trial = words[words.index("--trial") + 1]
    if trial is not None and any(launcher in words for launcher in _LAUNCHERS):
        out["entrypoint"] = trial
        return
    what = ("a DeepSpeedTrial (dtrain runs PyTorchTrial classes)" if "determined.launch.deepspeed" in words
            else "a script (Determined's Core API), not a Trial class")
    raise ConfigError(f"{where}: entrypoint {safeyaml.show(value, 80)} runs {what}; give 'module:TrialClass' of a "
                      "dtrain.PyTorchTrial, e.g. model_def:MyTrial")


def _resolve_consts(node: dict[str, Any]) -> dict[str, Any]:
    """``{type: const, val: V}`` is V: a constant written as a range is a plain value for dtrain run, and the
    same constant for every trial of a search."""
    resolved: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict):
            if value.get("type") == "const" and set(value) == {"type", "val"}:
                value = value["val"]
            else:
                value = _resolve_consts(value)
        resolved[key] = value
    return resolved


def _global_batch(hparams: Any, hint: int | None) -> int | None:
    gbs = hparams.get("global_batch_size") if isinstance(hparams, dict) else None
    if isinstance(gbs, int) and not isinstance(gbs, bool) and gbs >= 1:
        return gbs
    return hint


# -------------------------------------------------------------------------------------------- lengths


def _length(node: dict[str, Any], key: str, gbs: int | None, where: str, prefix: str, period: bool = False) -> None:
    """A length in records becomes batches (rounded down, at least one), as Determined's PyTorch trainer
    did; a period of 0 (any unit) means never, as in Determined."""
    value = node.get(key)
    name = f"{prefix}{key}"
    if isinstance(value, int) and not isinstance(value, bool) and prefix:
        raise ConfigError(f"{where}: {name}: got {value} with no unit; dtrain needs one: {key}: {{batches: {value}}} "
                          f"or {{epochs: {value}}}")
    if not isinstance(value, dict):
        return
    given = [v for u, v in value.items() if u in _LENGTH_UNITS and v is not None]
    if period and len(given) == 1 and type(given[0]) is int and given[0] == 0:
        node[key] = None
        return
    if "records" not in value:
        return
    records = value.pop("records")
    if records is None:
        return
    if isinstance(records, bool) or not isinstance(records, int) or records < 0:
        raise ConfigError(f"{where}: {name}.records: got {safeyaml.show(records)} ({type(records).__name__}); "
                          "expected an integer >= 1")
    if records == 0:
        raise ConfigError(f"{where}: {name}.records: got 0; a training length must be at least one record")
    if any(value.get(u) is not None for u in ("batches", "epochs")):
        raise ConfigError(f"{where}: {name}: give exactly one of 'batches', 'records' or 'epochs'")
    if gbs is None:
        raise ConfigError(f"{where}: {name}: {{records: {records}}} is converted with global_batch_size "
                          "(records // global_batch_size batches, as in Determined), and "
                          "hyperparameters.global_batch_size is not one integer; give the length in batches or "
                          "epochs")
    batches = max(records // gbs, 1)
    if batches > MAX_BATCHES:
        raise ConfigError(f"{where}: {name}.records: {safeyaml.show(records)} records are more than "
                          f"{MAX_BATCHES:,} batches of {gbs}; give a shorter length")
    value["batches"] = batches


def _searcher(searcher: dict[str, Any], where: str) -> None:
    ours = {k.split(".", 1)[1] for k in MAPPED if k.startswith("searcher.")}
    _suggest(searcher, set(SearcherConfig.model_fields) | ours, "searcher.", where)
    name = searcher.get("name")
    if isinstance(name, str) and name in _GONE_SEARCHERS:
        raise ConfigError(f"{where}: searcher.name: {name!r} ({_GONE_SEARCHERS[name]}) is not in dtrain, which has "
                          "single, grid, random and adaptive_asha; use adaptive_asha")
    if name == "async_halving":  # one bracket of ASHA: adaptive_asha's aggressive mode
        searcher["name"], searcher["mode"] = "adaptive_asha", "aggressive"
        if "num_rungs" in searcher:
            searcher["max_rungs"] = searcher.pop("num_rungs")
    for key in ("source_trial_id", "source_checkpoint_uuid"):
        if searcher.get(key) is not None:
            raise ConfigError(f"{where}: searcher.{key}: dtrain cannot start trials from a checkpoint of a Determined "
                              "cluster; drop it, and load the weights in the Trial's __init__")
        searcher.pop(key, None)
    # dtrain's ASHA stops a trial for good when it is not promoted (Determined's behaviour since 0.38).
    searcher.pop("stop_once", None)
    divisor = searcher.get("divisor")
    if isinstance(divisor, float) and divisor.is_integer():
        searcher["divisor"] = int(divisor)
    elif isinstance(divisor, float):
        raise ConfigError(f"{where}: searcher.divisor: got {divisor}; dtrain's successive halving (Optuna's) keeps "
                          "the best 1/divisor with an integer divisor: use e.g. 2, 3 or 4")
    _time_metric(searcher, where)


def _time_metric(searcher: dict[str, Any], where: str) -> None:
    """Determined 0.38's ``time_metric: batches, max_time: N`` is ``max_length: {batches: N}``."""
    metric, most = searcher.pop("time_metric", None), searcher.pop("max_time", None)
    if metric is None and most is None:
        return
    if metric not in ("batches", "epochs"):
        raise ConfigError(f"{where}: searcher.time_metric: got {safeyaml.show(metric)}; dtrain measures a trial's "
                          "progress in batches or epochs: use time_metric: batches (or epochs) with max_time")
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        raise ConfigError(f"{where}: searcher.max_time: got {safeyaml.show(most)}; expected the trial's length in "
                          f"{metric}, an integer >= 1")
    length = {metric: most}
    given = searcher.get("max_length")
    if given is not None and given != length:
        raise ConfigError(f"{where}: searcher.max_length {safeyaml.show(given)} and time_metric/max_time "
                          f"({metric}: {most}) disagree; keep one of the two")
    searcher["max_length"] = length
