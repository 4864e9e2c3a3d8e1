"""Term registry: each term module registers its :class:`~dtrain.explain.terms.base.Term` with :func:`register`;
the built-in modules are imported on first lookup, in the order a step is evaluated (a term may read an earlier
one's seconds). Adding a term is one module with a registered class: the cost model's step, ``--explain`` and
``--json`` find it here."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from dtrain.plugins import Plugins

if TYPE_CHECKING:
    from dtrain.explain.terms.base import Term

T = TypeVar("T", bound="type[Term]")

BUILTIN_MODULES = tuple(f"dtrain.explain.terms.{name}" for name in ("compute", "data", "fixed", "exchange",
                                                                      "late_rank"))
_TERMS: Plugins[type[Term]] = Plugins(BUILTIN_MODULES)


def register(cls: T) -> T:
    """Class decorator: make ``cls`` one of the cost model's terms, under ``cls.name``."""
    return _TERMS.register(cls)


def unregister(name: str) -> None:
    """Forget term ``name`` (a test's term, once the test is done)."""
    _TERMS.unregister(name)


def names() -> tuple[str, ...]:
    """Every registered term, built-ins first in their evaluation order."""
    return tuple(_TERMS.ordered())


def terms() -> list[Term]:
    """One instance of every registered term, in :func:`names`' order."""
    classes = _TERMS.classes()
    return [classes[name]() for name in names()]
