"""Names of Determined's that have no meaning without a Determined cluster: each says so, in one line, when
it is used (never at import, so that a model_def that merely imports them still loads)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from dtrain.errors import UserError


class NotHere(UserError, AttributeError):
    """A Determined name dtrain does not offer: the message says why and what to use instead. Also an
    ``AttributeError``, so that ``hasattr`` and ``getattr(obj, name, default)`` treat it as absent."""


def refuse(name: str, why: str) -> NoReturn:
    """Raise :class:`NotHere` for ``name`` (as the user wrote it) with ``why`` (the reason and the fix)."""
    raise NotHere(f"{name} is not available in dtrain: {why}")


def module_getattr(module: str, notes: Mapping[str, str], default: str | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` refusing the names in ``notes`` (and, with ``default``, every other public
    name) with one line; other names are plain AttributeErrors, as for any module."""

    def __getattr__(name: str) -> Any:
        why = notes.get(name, default if not name.startswith("_") else None)
        if why is not None:
            refuse(f"{module}.{name}", why)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
