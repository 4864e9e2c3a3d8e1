"""The file's own values, where the command line replaces them.

``--set resources.slots_per_trial=1`` (or ``--slots 1``) replaces whatever the file says there, so the
config that runs can be valid while the file is not: ``slots_per_trial: "2"`` would then never be read, and
the same file without the override fails. Each value the file gives under a replaced key is therefore
checked as the schema checks it, and a wrong one is refused naming the file's key and value.

What the file gives is checked, not what it leaves out: a file may lack keys that the command line
supplies (a required key, a half of ``max_length``), and a section's rules that relate several of its keys
judge the config that runs. Only a key's own type and bounds apply to the file's value.
"""

from __future__ import annotations

import contextlib
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from dtrain.config import safeyaml
from dtrain.config.bounds import MAX_GLOBAL_BATCH
from dtrain.config.determined import translate
from dtrain.config.model import HPARAM_TYPES, ExperimentConfig, check_plain, expected_phrase, reject_unknown_keys
from dtrain.errors import ConfigError

_MISSING = object()
# The pydantic errors that concern what a file leaves out, or keys it misspells (refused with a
# did-you-mean by reject_unknown_keys instead).
_NOT_GIVEN_VALUES = ("missing", "extra_forbidden")
# A section's own rules (model validators) relate its keys: value errors on a whole mapping.
_SECTION_RULE = "value_error"
_INT_OR_FLOAT = {"int_type": int, "float_type": float}


def check_replaced(written: dict[str, Any], overrides: list[str], source: str, batch_hint: int | None = None) -> None:
    """Refuse, in one line, a value of the file (``written``: as read, before overrides) under a key that
    an override replaces, when the schema would refuse it. Call after the overridden config validated:
    any other wrong value of the file has been refused already. A Determined config is judged in dtrain's
    vocabulary, as the config that runs is (its warning was given once already); ``batch_hint``: the
    global batch size that runs, to convert the file's records with when the file leaves it to ``--set``."""
    written = translate(written, source, batch_hint).raw
    replaced = _replaced(written, overrides)
    if not replaced:
        return
    # Keys misspelt in the file are only left where an override replaced their whole section.
    reject_unknown_keys(written, ExperimentConfig, prefix="", source=source)
    for path, item in replaced:
        if path[0] == "hyperparameters":
            _check_hyperparameters(written, path, item, source)
    try:
        ExperimentConfig.model_validate(written)
    except ValidationError as exc:
        for err in exc.errors():
            item = _replacing(err, replaced, written)
            if item is not None:
                raise ConfigError(_describe(err, item, source)) from None


def _replaced(written: dict[str, Any], overrides: list[str]) -> list[tuple[tuple[str, ...], str]]:
    """(key path, override) for every override that replaces a value the file gives."""
    found = []
    for item in overrides:
        path = tuple(item.partition("=")[0].split("."))
        if _value_at(written, path) is not _MISSING:
            found.append((path, item))
    return found


def _value_at(tree: Any, path: tuple[Any, ...]) -> Any:
    """The value at ``path`` (keys, and list indices in pydantic's error locations), else ``_MISSING``."""
    for part in path:
        inside = part in tree if isinstance(tree, dict) else (
            isinstance(tree, list) and isinstance(part, int) and 0 <= part < len(tree))
        if not inside:
            return _MISSING
        tree = tree[part]
    return tree


def _replacing(err: ErrorDetails, replaced: list[tuple[tuple[str, ...], str]], written: dict[str, Any]) -> str | None:
    """The override that replaced the value ``err`` is about, where that value is one the file gives (not a
    section whose rules relate several keys, nor a key it leaves out); else None."""
    if err["type"] in _NOT_GIVEN_VALUES:
        return None
    loc = tuple(err["loc"])
    value = _value_at(written, loc)
    if value is _MISSING or (err["type"] == _SECTION_RULE and isinstance(value, dict)):
        return None
    return next((item for path, item in replaced if loc[: len(path)] == path), None)


def _check_hyperparameters(written: dict[str, Any], path: tuple[str, ...], item: str, source: str) -> None:
    """Hyperparameters are the trial's own, free-form; what the schema asks of them (plain, finite values;
    a positive integer ``global_batch_size``) it asks of the file's too. A search range (a mapping) stays
    allowed where an override gives a single value."""
    value = _value_at(written, path)
    where = ".".join(safeyaml.plain(p, 60) for p in path)
    try:
        check_plain(value, where)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}{_but(item, source)}") from None
    if path not in (("hyperparameters",), ("hyperparameters", "global_batch_size")):
        return
    gbs = _value_at(written, ("hyperparameters", "global_batch_size"))
    if gbs is _MISSING or (isinstance(gbs, dict) and gbs.get("type") in HPARAM_TYPES):
        return
    if isinstance(gbs, bool) or not isinstance(gbs, int) or not 1 <= gbs <= MAX_GLOBAL_BATCH:
        raise ConfigError(f"{source}: hyperparameters.global_batch_size: got {safeyaml.show(gbs)} "
                          f"({type(gbs).__name__}); expected an integer from 1 to {MAX_GLOBAL_BATCH:,}"
                          f"{_but(item, source, gbs, int)}")


def _describe(err: ErrorDetails, item: str, source: str) -> str:
    loc = ".".join(safeyaml.plain(str(p), 60) for p in err["loc"])
    received = err.get("input")
    expected = expected_phrase(safeyaml.plain(err["msg"].removeprefix("Value error, "), 400))
    if err["type"].startswith("value_error"):  # a field's own rule: its message says what and why
        return f"{source}: {loc}: {expected}{_but(item, source)}"
    return (f"{source}: {loc}: got {safeyaml.show(received)} ({type(received).__name__}); expected {expected}"
            f"{_but(item, source, received, _INT_OR_FLOAT.get(err['type']))}")


def _but(item: str, source: str, value: Any = None, number: type | None = None) -> str:
    """The rest of the line: which override hides the value, and the fix (in the file)."""
    fix = f"fix it in {source}"
    if number is not None and isinstance(value, str):
        with contextlib.suppress(ValueError):  # "2" for an int: the quotes are the mistake
            number(value.strip())
            fix = f"write {safeyaml.plain(value.strip(), 40)} without quotes in {source}"
    return (f"; the command line's {safeyaml.plain(item, 120)} replaces it, but the file's own values must be valid "
            f"too: {fix}")
