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
    """The strategy the config asks for (only ``ddp`` exists so far); ``recorder`` times its collectives."""
    bucket_mb = config.optimizations.tensor_fusion_threshold if config is not None else 25.0
    return DDPStrategy(device, bucket_cap_mb=bucket_mb, recorder=recorder)
