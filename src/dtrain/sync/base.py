"""The one interface the trainer talks to for keeping replicas in sync.

A strategy owns wrapping the model and optimizer and every collective they need, in the spirit of
Lightning Fabric's strategies, minus the connector: the trainer never calls torch.distributed itself for
gradients or weights.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


class SyncStrategy(ABC):
    """How gradients (or weights) are exchanged between slots."""

    name: str = "base"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abstractmethod
    def setup_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device and wrap it so that its replicas stay identical."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    @abstractmethod
    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever wrapper :meth:`setup_model` returned."""

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient exchange inside this block (for gradient aggregation)."""
        yield

    def state_dict(self) -> dict[str, Any]:
        """Strategy state that a checkpoint must keep (compression buffers, ...)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


@runtime_checkable
class Rebucketable(Protocol):
    """Optional capability: change the gradient bucket size mid-run (for fusion auto-tuning)."""

    def rebuild(self, model: nn.Module, bucket_cap_mb: float) -> None: ...
