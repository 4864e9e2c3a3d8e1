"""Factor registry: each factor module registers its :class:`~dtrain.explain.factors.base.Factor` with
:func:`register`; the built-in modules are imported on first lookup. Adding a factor is one module with a
registered class: the doctor's table, time split, recommendations and ``--verify`` find it here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from dtrain.plugins import Plugins

if TYPE_CHECKING:
    from dtrain.explain.factors.base import Factor

F = TypeVar("F", bound="type[Factor]")

# In the order the table lists factors of equal time.
BUILTIN_MODULES = tuple(f"dtrain.explain.factors.{name}" for name in (
    "communication", "data_loading", "compute", "precision", "straggler", "batch_size", "sync_frequency"))
_FACTORS: Plugins[type[Factor]] = Plugins(BUILTIN_MODULES)


def register(cls: F) -> F:
    """Class decorator: make ``cls`` one of the doctor's factors, under ``cls.name``."""
    return _FACTORS.register(cls)


def unregister(name: str) -> None:
    """Forget factor ``name`` (a test's factor, once the test is done)."""
    _FACTORS.unregister(name)


def names() -> tuple[str, ...]:
    """Every registered factor, built-ins first in their documented order."""
    return tuple(_FACTORS.ordered())


def factors() -> list[Factor]:
    """One instance of every registered factor, in :func:`names`' order."""
    classes = _FACTORS.classes()
    return [classes[name]() for name in names()]
