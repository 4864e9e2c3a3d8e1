"""Weight-synchronization strategies, one module each, behind :class:`SyncStrategy`."""

from __future__ import annotations

import torch

from dtrain.config import ExperimentConfig
from dtrain.profiler import CommRecorder
from dtrain.sync.allreduce import AllReduceStrategy
from dtrain.sync.base import SyncStrategy
from dtrain.sync.ddp import DDPStrategy
from dtrain.sync.local_sgd import LocalSGDStrategy

__all__ = ["AllReduceStrategy", "DDPStrategy", "LocalSGDStrategy", "SyncStrategy", "build_strategy"]


def build_strategy(config: ExperimentConfig | None, device: torch.device,
                   recorder: CommRecorder | None = None) -> SyncStrategy:
    """The strategy the config asks for; ``recorder`` (the profiler's) times its collectives."""
    if config is None:  # dtrain.init(): plain DDP with torch's default bucket size
        return DDPStrategy(device, bucket_cap_mb=25.0, recorder=recorder)
    o, name = config.optimizations, config.sync.strategy
    if name == "allreduce":
        return AllReduceStrategy(device, o.tensor_fusion_threshold, o.gradient_compression, recorder)
    if name == "local_sgd":
        opts = config.sync.local_sgd
        return LocalSGDStrategy(device, opts.period, opts.warmup_steps, o.tensor_fusion_threshold,
                                o.gradient_compression, recorder)
    if name == "fsdp":
        from dtrain.sync.fsdp import FSDPStrategy  # imports torch.distributed.checkpoint: 0.4 s, only if used

        return FSDPStrategy(device, recorder)
    if name == "parameter_server":
        from dtrain.sync.parameter_server import ParameterServerStrategy

        return ParameterServerStrategy(device, config.sync.parameter_server, recorder)
    return DDPStrategy(device, bucket_cap_mb=o.tensor_fusion_threshold, compression=o.gradient_compression,
                       powersgd=o.powersgd, recorder=recorder, rebuildable=o.auto_tune_tensor_fusion,
                       seed=config.seed, native_timing=o.aggregation_frequency == 1)
