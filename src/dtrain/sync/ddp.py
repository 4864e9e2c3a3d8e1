"""``ddp``: PyTorch DistributedDataParallel, bucketed all-reduce overlapped with backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain.profiler import CommRecorder, timed_allreduce_hook
from dtrain.sync.base import SyncStrategy


class DDPStrategy(SyncStrategy):
    name = "ddp"

    def __init__(self, device: torch.device, bucket_cap_mb: float, recorder: CommRecorder | None = None) -> None:
        super().__init__(device)
        # optimizations.tensor_fusion_threshold is DDP's bucket size: gradients are fused into buckets of
        # this many MB and each bucket is all-reduced as one message while backward continues.
        self.bucket_cap_mb = bucket_cap_mb
        self.recorder = recorder

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            # One slot: nothing to synchronize. Plain training is the honest baseline that N slots are
            # compared with (DDP would still copy every gradient through a one-process all-reduce).
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers at construction, so replicas start identical
        # even if a trial forgot to seed its initialisation.
        ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=self.bucket_cap_mb)
        if self.recorder is not None:
            # DDP's default all-reduce, as a hook that lets the profiler see each bucket start and finish.
            ddp.register_comm_hook(self.recorder, timed_allreduce_hook)
        return ddp

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            yield
