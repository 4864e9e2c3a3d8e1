"""Changes made to a user's script from outside, without editing it: one typed record (:class:`Overrides`).

``dtrain doctor RUN --try KEY=VALUE`` and ``--verify`` spell them; the script's hooks apply them
(:mod:`dtrain.profiling.script.hooks`: ``DistributedDataParallel.__init__``'s arguments, the DataLoader's, DDP's
comm hook before the first backward, TF32 at the start) when the process finds them in :data:`ENV` as JSON. The
slot and node counts are the launcher's (``dtrain launch --slots``), not the hooks'.

Torch-free: the command line parses these before anything starts.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from dtrain.config.bounds import MAX_FUSION_MB, MAX_LOADER_WORKERS, MAX_SLOTS
from dtrain.errors import UserError

ENV = "DTRAIN_SCRIPT_OVERRIDES"
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
log = logging.getLogger("dtrain")


@dataclass(frozen=True)
class Overrides:
    """What a script run changes from outside (None: as the script has it)."""

    slots: int | None = None
    nodes: int | None = None
    bucket_cap_mb: float | None = None
    comm_hook: str | None = None  # one of COMM_HOOKS ("none": no hook is added)
    static_graph: bool | None = None
    find_unused_parameters: bool | None = None
    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    tf32: bool | None = None

    def given(self) -> dict[str, Any]:
        """The fields set, by field name."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def spelled(self) -> list[str]:
        """The fields set, as ``KEY=VALUE`` the way a user types them."""
        names = {f: k for k, (f, _, _) in KEYS.items()}
        return [f"{names[f]}={_text(v)}" for f, v in self.given().items()]

    def to_env(self) -> str:
        """The hooks' part (not the launcher's slots and nodes) as :data:`ENV`'s JSON."""
        return json.dumps({k: v for k, v in self.given().items() if k not in ("slots", "nodes")})


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def _int(low: int, high: int) -> Callable[[str], int]:
    def read(text: str) -> int:
        if not text.isdigit() or not low <= int(text) <= high:
            raise ValueError(f"a whole number from {low} to {high:,}")
        return int(text)
    return read


def _mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_FUSION_MB:
        raise ValueError(f"megabytes above 0, at most {MAX_FUSION_MB:g}")
    return value


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError("true or false")
    return text.lower() == "true"


def _hook(text: str) -> str:
    if text.lower() not in COMM_HOOKS:
        raise ValueError(f"one of {', '.join(COMM_HOOKS)}")
    return text.lower()


# key -> (field, reader, what it does): the keys a script run accepts.
KEYS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "slots": ("slots", _int(1, MAX_SLOTS), "processes of the job (the global batch changes with them)"),
    "nodes": ("nodes", _int(1, MAX_SLOTS), "machines the slots are spread over"),
    "ddp.bucket_cap_mb": ("bucket_cap_mb", _mb, "DDP's bucket size"),
    "ddp.comm_hook": ("comm_hook", _hook, "gradient compression as a DDP comm hook"),
    "ddp.static_graph": ("static_graph", _bool, "DDP's static_graph (in place of find_unused_parameters=True)"),
    "ddp.find_unused_parameters": ("find_unused_parameters", _bool, "DDP's search for unused parameters"),
    "loader.num_workers": ("num_workers", _int(0, MAX_LOADER_WORKERS), "DataLoader worker processes"),
    "loader.pin_memory": ("pin_memory", _bool, "DataLoader pin_memory"),
    "loader.persistent_workers": ("persistent_workers", _bool, "DataLoader persistent_workers"),
    "tf32": ("tf32", _bool, "TF32 matmuls and convolutions on CUDA"),
}
# Changes only an edit of the script makes: key -> which construction site to name, and what to change there.
EDIT_ONLY: dict[str, tuple[str, str]] = {
    "precision": ("backward", "run the forward and the loss under torch.autocast(device_type, dtype=...) (and, "
                              "for float16, a torch.amp.GradScaler), before the loss's backward"),
    "batch_size": ("loader", "change the DataLoader's batch_size (the global batch is it times the slots)"),
    "global_batch_size": ("loader", "change the DataLoader's batch_size (the global batch is it times the slots)"),
}


def accepted() -> str:
    """The keys a script run accepts, for error lines."""
    return ", ".join(KEYS)


def parse_item(item: str, edit_only: bool = False) -> tuple[str, Any]:
    """``KEY=VALUE`` as (key, value); :class:`UserError` (one line, the keys listed) for a bad key or value.
    ``edit_only``: also accept a key only an edit of the script makes (its value kept as text)."""
    key, sep, text = item.partition("=")
    key, text = key.strip(), text.strip()
    if not sep or not key or not text:
        raise UserError(f"--try expects KEY=VALUE (e.g. loader.num_workers=4); got {item!r}; a script run "
                        f"accepts {accepted()}")
    if key in EDIT_ONLY and edit_only:
        return key, text
    if key not in KEYS:
        edit = f" ({key} is made by an edit of the script: dtrain doctor --try names the line)" \
            if key in EDIT_ONLY else ""
        raise UserError(f"--try {item}: a script run has no key {key!r}{edit}; it accepts {accepted()}")
    read = KEYS[key][1]
    try:
        return key, read(text)
    except ValueError as exc:
        raise UserError(f"--try {item}: {key} takes {exc}; got {text!r}") from None


def parse(items: list[str]) -> Overrides:
    """Every ``KEY=VALUE`` into one record (a later value of a key replaces an earlier one)."""
    found = Overrides()
    for item in items:
        key, value = parse_item(item)
        found = replace(found, **{KEYS[key][0]: value})
    return found


def from_env(environ: Mapping[str, str] = os.environ) -> Overrides | None:
    """The record the launcher put in :data:`ENV` (None: none; a damaged one is one log line, and ignored)."""
    text = environ.get(ENV, "")
    if not text:
        return None
    try:
        data = json.loads(text)
        known = {f.name for f in fields(Overrides)}
        if not isinstance(data, dict) or set(data) - known:
            raise ValueError(f"expected an object with keys from {', '.join(sorted(known))}")
        return Overrides(**data)
    except (ValueError, TypeError) as exc:
        log.warning("dtrain: %s ignored (%s)", ENV, exc)
        return None
