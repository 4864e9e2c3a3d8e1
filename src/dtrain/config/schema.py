"""Typed experiment config: the single source of truth for a run.

Loading goes one way: :mod:`.safeyaml` reads the file (bounded), :mod:`.determined` translates a Determined
experiment config's keys, :mod:`.model`'s pydantic models validate, and :mod:`.filevalues` checks the file's
own values where ``--set`` replaced them. Everything is validated once, in the launcher, before any worker
starts; workers re-read the resolved ``config.yaml`` from the run directory. The models are re-exported here,
where the rest of dtrain imports them from.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dtrain.config import safeyaml
from dtrain.config.determined import translate
from dtrain.config.filevalues import check_replaced
from dtrain.config.model import (
    HPARAM_TYPES,
    CheckpointStorage,
    DataLoaderOptions,
    ExperimentConfig,
    Length,
    Optimizations,
    Profiling,
    Resources,
    SearcherConfig,
    SyncOptions,
    check_name,
    check_storage_path,
    describe_error,
    first_range,
    reject_unknown_keys,
)
from dtrain.errors import ConfigError

__all__ = [
    "HPARAM_TYPES", "CheckpointStorage", "DataLoaderOptions", "ExperimentConfig", "Length", "Optimizations",
    "Profiling", "Resources", "SearcherConfig", "SyncOptions", "apply_override", "check_name",
    "check_storage_path", "config_from_dict", "dump_config", "first_range", "load_config",
]


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read, override and validate an experiment config; raise :class:`ConfigError` with one clear line.

    The file goes through :mod:`dtrain.config.safeyaml` (bounded size, nesting and aliases; no duplicate keys)
    before anything else looks at it; ``--set`` values go through the same reader. A value of the file that
    an override replaces must be valid too (:func:`dtrain.config.filevalues.check_replaced`).
    """
    path = Path(path)
    raw = _read_yaml(path)
    written = copy.deepcopy(raw) if overrides else raw
    for item in overrides or []:
        apply_override(raw, item)
    here = path.resolve().parent
    given = raw.get("code_dir")
    if isinstance(given, str) and given and not Path(given).is_absolute():
        # Relative to the config file, as the default is: not to wherever the command happens to run.
        raw["code_dir"] = str(here / given)
    raw.setdefault("code_dir", str(here))
    source = safeyaml.plain(str(path))
    config = config_from_dict(raw, source=source)
    if overrides:
        check_replaced(written, overrides, source, config.global_batch_size)
    return config


def config_from_dict(raw: dict[str, Any], source: str = "config", warn: bool = True) -> ExperimentConfig:
    """Validate a plain mapping (as read from YAML) into an :class:`ExperimentConfig`. A Determined experiment
    config is read as it is (:mod:`dtrain.config.determined`); ``warn``: log the one line naming the
    Determined keys it ignored."""
    translation = translate(raw, source)
    raw = translation.raw
    warning = translation.warning(source)
    if warn and warning is not None:
        logging.getLogger(__name__).warning("%s", warning)
    reject_unknown_keys(raw, ExperimentConfig, prefix="", source=source)
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_error(exc, source)) from None


def dump_config(config: ExperimentConfig, path: Path) -> None:
    path.write_text(safeyaml.dump(config.model_dump(mode="json")))


def _read_yaml(path: Path) -> dict[str, Any]:
    data = safeyaml.read_file(path)
    if not isinstance(data, dict):
        raise ConfigError(
            f"{safeyaml.plain(str(path))}: expected a mapping of config keys at the top level, got "
            f"{type(data).__name__}; start the file with keys such as 'entrypoint:'"
        )
    return data


_MAX_OVERRIDE_KEY = 256
_MAX_OVERRIDE_PARTS = 8


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``--set a.b=value`` override; the value is parsed as YAML (so ``4`` is an int), by the same
    bounded reader as the file; text that is not YAML at all is taken as a string."""
    key, sep, text = item.partition("=")
    parts = key.split(".")
    if not sep or not key or any(not part for part in parts):
        raise ConfigError(f"--set expects KEY=VALUE with a dotted key, e.g. resources.slots_per_trial=2; "
                          f"got {safeyaml.show(item)}")
    if len(key) > _MAX_OVERRIDE_KEY or len(parts) > _MAX_OVERRIDE_PARTS or not key.isprintable():
        raise ConfigError(f"--set {safeyaml.show(key)}: a key is at most {_MAX_OVERRIDE_PARTS} printable names "
                          f"joined by dots, {_MAX_OVERRIDE_KEY} characters in all; use a key of the config")
    try:
        value = safeyaml.load_text(text, source=f"--set {key}") if text else ""
    except safeyaml.MalformedYaml:
        value = text
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {safeyaml.show(item)}: {safeyaml.show(part)} is a {type(child).__name__}, "
                              "not a section")
        node = child
    node[parts[-1]] = value
