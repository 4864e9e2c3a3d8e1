"""A tiny classifier whose steps are counted: a callback profiles a few steps of the real loop on CPU and
writes the names of the operations they ran (see tests/engine/test_step_ops.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import dtrain


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(1024, 16, generator=g), torch.randint(0, 4, (1024,), generator=g))


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


class Profile:
    """torch.profiler over whole steps (CPU): from the end of step ``first - 1`` to the end of step
    ``first + steps - 1``; the names of the events in between."""

    def __init__(self, first: int, steps: int) -> None:
        self.first, self.steps = first, steps
        self.names: list[str] = []
        self._profiler: Any = None

    def at_step_end(self, step: int) -> None:
        if step == self.first - 1:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.start()
        elif step == self.first + self.steps - 1:
            self._profiler.stop()
            self.names = [event.name for event in self._profiler.events()]


class _Counted(dtrain.LoopCallback):
    def __init__(self, profile: Profile, out: Path) -> None:
        self.profile, self.out = profile, out

    def on_step_end(self, batch_idx: int) -> None:
        self.profile.at_step_end(batch_idx)
        if self.profile.names:
            self.out.write_text(json.dumps(self.profile.names))
            self.profile.names = []


class StepOpsTrial(dtrain.PyTorchTrial):
    def __init__(self, context: dtrain.TrialContext) -> None:
        super().__init__(context)
        self.hp = context.get_hparams()
        self.model = context.wrap_model(model())
        self.optimizer = context.wrap_optimizer(torch.optim.AdamW(self.model.parameters(), lr=1e-3))

    def build_training_data(self) -> TensorDataset:
        return data()

    def build_validation_data(self) -> None:
        return None

    def build_callbacks(self) -> dict[str, dtrain.LoopCallback]:
        profile = Profile(self.hp["first"], self.hp["steps"])
        return {"count": _Counted(profile, Path(self.hp["out"]))}

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = loss_of(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.optimizer)
        return {"loss": loss}
