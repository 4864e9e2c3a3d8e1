"""Which hyperparameters a trial reads: a misspelled one (``learning_rate`` where the trial reads ``lr``)
would otherwise train with the trial's default, silently.

:class:`HparamReads` hands the trial its hyperparameters (``get_hparam(name)``, ``get_hparams()``) and
notes every name read. ``get_hparams()`` gives a :class:`TrackedHparams`, a ``dict`` that notes the keys
read through it: ``[]``, ``get``, ``setdefault``, ``pop``; ``items()``, ``values()``, ``copy()``, ``dict(hp)``,
``{**hp}``, ``f(**hp)``, ``json.dumps``, pickling and ``copy.deepcopy`` read them all. Nested mappings are
tracked too (``optimizer.lr``). Looking at names only (``in``, ``keys()``, iterating) reads no value.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any

import yaml

from dtrain.errors import UserError

# Hyperparameters dtrain itself reads: never the trial's to read.
OWN = frozenset({"global_batch_size"})


class TrackedHparams(dict):  # type: ignore[type-arg]
    """A copy of the hyperparameters that tells :class:`HparamReads` which keys were read."""

    _reads: HparamReads | None = None  # None on a copy made without one (then a plain dict)
    _prefix = ""

    def _read(self, key: Any) -> None:
        if self._reads is not None:
            self._reads.read.add(f"{self._prefix}{key}")

    def _read_all(self) -> None:
        if self._reads is not None:
            self._reads.read.update(f"{self._prefix}{k}" for k in dict.keys(self))
            for value in dict.values(self):
                if isinstance(value, TrackedHparams):
                    value._read_all()

    def __getitem__(self, key: Any) -> Any:
        self._read(key)
        return dict.__getitem__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._read(key)
        return dict.get(self, key, default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._read(key)
        return dict.setdefault(self, key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self._read(key)
        return dict.pop(self, key, *default)

    def items(self) -> Any:
        self._read_all()
        return dict.items(self)

    def values(self) -> Any:
        self._read_all()
        return dict.values(self)

    def copy(self) -> dict[Any, Any]:
        return self.plain()

    def __iter__(self) -> Iterator[Any]:
        # Overridden only so that dict(hp), {**hp} and f(**hp) take CPython's general path (keys, then
        # __getitem__ for each), which notes the keys read, instead of copying the storage directly.
        return dict.__iter__(self)

    def __or__(self, other: Any) -> Any:
        return self.plain() | other

    def __ror__(self, other: Any) -> Any:
        return other | self.plain()

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickle, copy, deepcopy: a plain dict, all of it read
        return (dict, (self.plain(),))

    def plain(self) -> dict[Any, Any]:
        """A plain ``dict`` copy (nested ones too); every key counts as read."""
        self._read_all()
        return {k: v.plain() if isinstance(v, TrackedHparams) else v for k, v in dict.items(self)}


def _represent(dumper: yaml.SafeDumper, data: TrackedHparams) -> Any:
    return dumper.represent_dict(data.plain())


# yaml.safe_dump(context.get_hparams()) works as with the plain dict it used to be.
yaml.SafeDumper.add_representer(TrackedHparams, _represent)
yaml.Dumper.add_representer(TrackedHparams, _represent)


class HparamReads:
    """The experiment's hyperparameters as the trial reads them, and the names it read."""

    def __init__(self, hparams: Mapping[str, Any]) -> None:
        self.hparams = hparams
        self.read: set[str] = set()

    def _tracked(self, value: Mapping[str, Any], prefix: str) -> TrackedHparams:
        out = TrackedHparams({k: self._tracked(v, f"{prefix}{k}.") if isinstance(v, Mapping) else v
                              for k, v in value.items()})
        out._reads, out._prefix = self, prefix
        return out

    def get_hparams(self) -> TrackedHparams:
        """All hyperparameters, as a dict of their own (changing it changes nothing else)."""
        return self._tracked(self.hparams, "")

    def get_hparam(self, name: str) -> Any:
        """One hyperparameter; a name not in the config is a one-line :class:`UserError`."""
        if name not in self.hparams:
            known = ", ".join(sorted(self.hparams))
            raise UserError(f"hyperparameter {name!r} is not in the config (have: {known}); add it under "
                            "hyperparameters:")
        self.read.add(name)
        value = self.hparams[name]
        return self._tracked(value, f"{name}.") if isinstance(value, Mapping) else value

    def unread(self) -> list[str]:
        """Names set in the config that the trial never read (dotted below a nested mapping it read)."""
        out: list[str] = []

        def walk(value: Mapping[str, Any], prefix: str) -> None:
            for key, item in value.items():
                name = f"{prefix}{key}"
                if name not in self.read:
                    out.append(name)
                elif isinstance(item, Mapping):
                    walk(item, f"{name}.")

        walk({k: v for k, v in self.hparams.items() if k not in OWN}, "")
        return out

    def warning(self) -> str | None:
        """One line naming the hyperparameters set but never read, each with the read name it may stand
        for; None when the trial read every one."""
        unread = self.unread()
        if not unread:
            return None
        names = [f"{n} (did you mean {m}?)" if (m := suggest(n, self.read)) else n for n in unread]
        return (f"hyperparameters set but never read by the trial: {', '.join(names)}; they change nothing "
                "(no rank read them during the run)")


def _initials(name: str) -> str:
    parts = [p for p in name.replace("-", "_").split("_") if p]
    return "".join(p[0] for p in parts) if len(parts) > 1 else ""


def suggest(name: str, read: set[str]) -> str | None:
    """The read name ``name`` most likely stands for: a close spelling (difflib), else the same initials
    (``learning_rate`` and ``lr``), within the same nesting."""
    prefix, _, leaf = name.rpartition(".")
    peers = {r.rpartition(".")[2]: r for r in read if r.rpartition(".")[0] == prefix and r != name}
    close = difflib.get_close_matches(leaf, list(peers), n=1)
    if close:
        return peers[close[0]]
    for peer, full in sorted(peers.items()):
        if _initials(leaf) == peer or _initials(peer) == leaf:
            return full
    return None
