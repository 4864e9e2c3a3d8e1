"""``allreduce``: no DDP wrapper. Rank 0's weights are broadcast at start; after backward, gradients are
averaged by all-reduce of fused buffers of at most ``optimizations.tensor_fusion_threshold`` MB.

For models DDP cannot wrap, and as a transparent reference for what DDP does (minus the overlap with
backward: here all communication is exposed, which the profiler shows).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from dtrain import dist as ddist
from dtrain.profiling.comm import NULL_RECORDER, CommRecorder
from dtrain.sync.base import SyncStrategy, broadcast_from_chief
from dtrain.sync.compression import COMPRESSORS, Compressor
from dtrain.sync.options import DEFAULT_FUSION_MB
from dtrain.sync.registry import register

if TYPE_CHECKING:
    from dtrain.sync.options import StrategyConfig


def fused_buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors grouped so that each group is at most ``cap_bytes`` (a tensor larger than the
    cap gets a group of its own); dtype changes start a new group, since a group becomes one buffer."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > cap_bytes or buckets[-1][0].dtype != t.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


def average_gradients(params: Iterable[nn.Parameter], cap_mb: float, compressor: Compressor,
                      recorder: CommRecorder = NULL_RECORDER) -> None:
    """Average ``.grad`` of ``params`` across ranks: one all-reduce per fused bucket, all in flight together.

    A parameter with no gradient on this step gets a zero gradient, so that every rank reduces the same
    buffers (DDP instead tracks unused parameters, at a cost).
    """
    world = dist.get_world_size()
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    pending = []
    for bucket in fused_buckets(grads, max(1, int(cap_mb * 2**20))):
        flat = torch.cat([g.reshape(-1) for g in bucket]).div_(world)
        wire, ctx = compressor.compress(flat)
        recorder.launch(wire.numel() * wire.element_size())
        pending.append((bucket, dist.all_reduce(wire, async_op=True), wire, ctx))
    for bucket, work, wire, ctx in pending:
        work.wait()
        recorder.complete()
        flat = compressor.decompress(wire, ctx)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


@register
class AllReduceStrategy(SyncStrategy):
    name = "allreduce"
    compressions = frozenset({"none", "fp16", "bf16"})
    exchanges_in_step = True
    one_slot_stand_in = "single_device"

    def __init__(self, device: torch.device, bucket_cap_mb: float, compression: str = "none",
                 recorder: CommRecorder = NULL_RECORDER) -> None:
        super().__init__(device, recorder)
        self.bucket_cap_mb = bucket_cap_mb
        self.compressor = COMPRESSORS[compression]
        self.world = ddist.world_size()

    @classmethod
    def from_config(cls, config: StrategyConfig | None, device: torch.device,
                    recorder: CommRecorder = NULL_RECORDER) -> AllReduceStrategy:
        if config is None:  # dtrain.init(): uncompressed, the default fusion
            return cls(device, DEFAULT_FUSION_MB, "none", recorder)
        o = config.optimizations
        return cls(device, o.tensor_fusion_threshold, o.gradient_compression, recorder)

    @property
    def fusion_threshold_mb(self) -> float:
        return self.bucket_cap_mb

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if self.world > 1:
            broadcast_from_chief(model)
        return model

    def exchange_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.world > 1:
            # Zero (0 MB) means "no fusion": one all-reduce per tensor, as with DDP's bucket_cap_mb=0.
            cap = self.bucket_cap_mb if self.bucket_cap_mb > 0 else 1e-9
            average_gradients(optimizer_params(optimizer), cap, self.compressor, self.recorder)
