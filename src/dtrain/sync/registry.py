"""Strategy registry: ``sync.strategy`` name -> class. Each strategy module registers itself with
:func:`register`; the built-in modules are imported on first lookup (so ``dtrain --help`` stays fast).
Adding a strategy is one module with a registered class: nothing else names strategies.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, TypeVar

from dtrain.plugins import Plugins

if TYPE_CHECKING:
    import torch

    from dtrain.profiling.comm import CommRecorder
    from dtrain.sync.base import SyncStrategy
    from dtrain.sync.options import StrategyConfig

S = TypeVar("S", bound="type[SyncStrategy]")

BUILTIN_MODULES = ("dtrain.sync.ddp", "dtrain.sync.allreduce", "dtrain.sync.parameter_server",
                   "dtrain.sync.local_sgd", "dtrain.sync.fsdp", "dtrain.sync.single")
_STRATEGIES: Plugins[type[SyncStrategy]] = Plugins(BUILTIN_MODULES)


def register(cls: S) -> S:
    """Class decorator: make ``cls`` selectable as ``sync.strategy: <cls.name>``."""
    return _STRATEGIES.register(cls)


def names() -> tuple[str, ...]:
    """Every registered strategy name to choose from, built-ins first in their documented order (not those
    that train one slot only: ``dtrain compare`` runs each of these on the same slots)."""
    classes = _STRATEGIES.classes()
    return tuple(n for n in _STRATEGIES.ordered() if not classes[n].one_slot_only)


def lookup(name: str) -> type[SyncStrategy]:
    """The class registered as ``name``; KeyError with a did-you-mean otherwise."""
    classes = _STRATEGIES.classes()
    if name not in classes:
        raise KeyError(unknown_message(name))
    return classes[name]


def unknown_message(name: str) -> str:
    close = difflib.get_close_matches(name, list(_STRATEGIES.classes()), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{name!r} is not a strategy; {hint}registered: {', '.join(names())}"


def build(config: StrategyConfig | None, device: torch.device, recorder: CommRecorder) -> SyncStrategy:
    """The strategy the config asks for (``dtrain.init()``: plain DDP); ``recorder`` times its collectives.
    In a world of one, a strategy whose one slot is plain training is stood in for by the single-device
    strategy (:mod:`dtrain.sync.single`)."""
    from dtrain import dist as ddist

    configured = lookup(config.sync.strategy if config is not None else "ddp")
    if configured.one_slot_stand_in is not None and not ddist.is_distributed():
        return lookup(configured.one_slot_stand_in).standing_in(configured, config, device, recorder)
    return configured.from_config(config, device, recorder)
