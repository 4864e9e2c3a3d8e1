"""``fsdp``: fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``).

Each slot keeps 1/N of every parameter, gradient and optimizer state; parameters are all-gathered for
forward and backward and gradients reduce-scattered, so a model N times too big for one slot fits.
Checkpoints hold the full state dict in the same ``model.pt`` format as every other strategy.
Build the optimizer *after* ``wrap_model``: sharding replaces the parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dtrain import dist as ddist
from dtrain.profiling.record import SHARDED
from dtrain.sync.base import SyncStrategy
from dtrain.sync.registry import register


def _fsdp() -> Any:
    # FSDP pulls in torch.distributed.checkpoint and DTensor, slow to import: imported when a run uses it.
    import torch.distributed.fsdp as fsdp

    return fsdp


def _is_sharded(model: nn.Module) -> bool:
    return isinstance(model, _fsdp().FSDPModule)


@register
class FSDPStrategy(SyncStrategy):
    name = "fsdp"
    per_rank_optimizer_state = True  # each rank holds its shard of the optimizer state
    comm_measured = False  # all-gathers and reduce-scatters run inside FSDP's own hooks
    exchange = SHARDED
    forward_needs_every_rank = True  # each layer's forward all-gathers its shards

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if not ddist.is_distributed():
            return model
        # The run's own device type: without a mesh, torch builds one on whatever accelerator is visible, so
        # a Gloo run on a GPU machine would put its shards on cuda:0 and its inputs beside them.
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (ddist.world_size(),))
        # One FSDP unit per direct child that owns parameters (its all-gather overlaps the previous
        # child's compute), then the root for whatever parameters remain.
        fully_shard = _fsdp().fully_shard
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if _is_sharded(model):
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)  # type: ignore[operator]
        else:
            yield

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        if not _is_sharded(model):
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Collective: gathers the shards on rank 0.
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        if not _is_sharded(model):
            model.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    @staticmethod
    def local_numel(model: nn.Module) -> int:
        """Elements of parameters this rank stores (its shards)."""
        total = 0
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel()
        return total


def local_optimizer_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of optimizer state this rank stores."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel()
    return total
