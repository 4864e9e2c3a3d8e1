"""Factor registry: each factor module registers its :class:`~dtrain.explain.factors.base.Factor` with
:func:`register`; the built-in modules are imported on first lookup. Adding a factor is one module with a
registered class: the doctor's table, time split, recommendations and ``--verify`` find it here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from dtrain.explain.factors.base import Factor

F = TypeVar("F", bound="type[Factor]")

# In the order the table lists factors of equal time.
BUILTIN_MODULES = tuple(f"dtrain.explain.factors.{name}" for name in (
    "communication", "data_loading", "compute", "precision", "straggler", "batch_size", "sync_frequency"))
_FACTORS: dict[str, type[Factor]] = {}
_loaded = False


def register(cls: F) -> F:
    """Class decorator: make ``cls`` one of the doctor's factors, under ``cls.name``."""
    _FACTORS[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Forget factor ``name`` (a test's factor, once the test is done)."""
    _FACTORS.pop(name, None)


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def names() -> tuple[str, ...]:
    """Every registered factor, built-ins first in their documented order."""
    _load_builtins()

    def order(name: str) -> int:
        module = _FACTORS[name].__module__
        return BUILTIN_MODULES.index(module) if module in BUILTIN_MODULES else len(BUILTIN_MODULES)

    return tuple(sorted(_FACTORS, key=order))


def factors() -> list[Factor]:
    """One instance of every registered factor, in :func:`names`' order."""
    return [_FACTORS[name]() for name in names()]
