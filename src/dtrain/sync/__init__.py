"""Weight-synchronization strategies, one module each, behind :class:`SyncStrategy`."""

from __future__ import annotations

import torch

from dtrain.config import ExperimentConfig
from dtrain.profiler import CommRecorder
from dtrain.sync.base import SyncStrategy
from dtrain.sync.ddp import DDPStrategy

__all__ = ["DDPStrategy", "SyncStrategy", "build_strategy"]


def build_strategy(config: ExperimentConfig | None, device: torch.device,
                   recorder: CommRecorder | None = None) -> SyncStrategy:
    """The strategy the config asks for; ``recorder`` (the profiler's) times its collectives."""
    if config is None:  # dtrain.init(): plain DDP with torch's default bucket size
        return DDPStrategy(device, bucket_cap_mb=25.0, recorder=recorder)
    o = config.optimizations
    return DDPStrategy(device, bucket_cap_mb=o.tensor_fusion_threshold, compression=o.gradient_compression,
                       powersgd=o.powersgd, recorder=recorder, rebuildable=o.auto_tune_tensor_fusion,
                       seed=config.seed)
