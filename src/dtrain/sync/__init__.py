"""Weight-synchronization strategies, one module each, behind :class:`SyncStrategy` and a registry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.sync import registry
from dtrain.sync.base import Rebucketable, Serving, SyncStrategy

if TYPE_CHECKING:
    import torch

    from dtrain.config.schema import ExperimentConfig
    from dtrain.profiling.comm import CommRecorder

__all__ = ["Rebucketable", "Serving", "SyncStrategy", "build_strategy", "registry"]


def build_strategy(config: ExperimentConfig | None, device: torch.device, recorder: CommRecorder) -> SyncStrategy:
    """The strategy the config asks for (``dtrain.init()``: plain DDP); ``recorder`` times its collectives."""
    name = config.sync.strategy if config is not None else "ddp"
    return registry.lookup(name).from_config(config, device, recorder)
