"""The one interface the trainer talks to for keeping replicas in sync.

A strategy owns wrapping the model and optimizer and every collective they need, in the spirit of
Lightning Fabric's strategies, minus the connector: the trainer never calls torch.distributed itself for
gradients or weights. One optimizer step is::

    exchange_gradients(opt)   # collective strategies: make gradients global (timed as communication)
    step(opt)                 # the update (timed as optimizer)
    after_step(opt)           # e.g. local SGD's periodic weight averaging (timed as communication)
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from dtrain.profiler import CommRecorder


class SyncStrategy(ABC):
    """How gradients (or weights) are exchanged between slots."""

    name: str = "base"
    # Replicas can differ between synchronizations (local SGD): each rank's own weights are checkpointed.
    replicas_may_differ: bool = False
    # Optimizer state is not the same on every rank (sharded, or local): it is checkpointed per rank.
    per_rank_optimizer_state: bool = False

    # Whether exchange_gradients/after_step communicate (timed as exposed communication) or do nothing
    # (DDP and FSDP communicate inside backward).
    exchanges_in_step: bool = False
    # Ranks that train (the data-parallel group); a parameter server also has ranks that only serve.
    is_server: bool = False
    dp_group: Any = None  # None: every rank

    def __init__(self, device: torch.device, recorder: CommRecorder | None = None) -> None:
        self.device = device
        self.recorder = recorder

    @property
    def dp_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def dp_world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_initialized() else 1

    def refresh(self) -> None:
        """Make this rank's weights current before validating or checkpointing (asynchronous strategies)."""
        return None

    @abstractmethod
    def setup_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device and wrap it so that its replicas stay in sync."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever wrapper :meth:`setup_model` returned."""
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient exchange inside this block (for gradient aggregation)."""
        yield

    def exchange_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the update: strategies that do not communicate during backward do it here."""
        return None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After the update: e.g. periodic weight averaging."""
        return None

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full, unsharded state dict of the user's module. Called on every rank (may be collective);
        only the chief's result is written."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        self.unwrap(model).load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """This rank's strategy state that a checkpoint must keep (compression buffers, ...)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


@runtime_checkable
class Rebucketable(Protocol):
    """Optional capability: change the gradient bucket size mid-run (for fusion auto-tuning)."""

    def rebuild(self, model: nn.Module, bucket_cap_mb: float) -> None: ...


def broadcast_from_chief(model: nn.Module) -> None:
    """Make every replica start from rank 0's parameters and buffers (what DDP does at construction)."""
    import torch.distributed as dist

    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)
