"""Trials with one planted bottleneck each, for the doctor's tests."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import dtrain


class SlowDataset(Dataset):
    """Every record takes a few milliseconds to load (a slow disk or decoder)."""

    def __init__(self, size: int, seconds: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 8, generator=g)
        self.y = torch.randn(size, 1, generator=g)
        self.seconds = seconds

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.seconds:
            time.sleep(self.seconds)
        return self.x[i], self.y[i]


class _Regression(dtrain.PyTorchTrial):
    def make_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def __init__(self, context: dtrain.TrialContext) -> None:
        super().__init__(context)
        self.model = context.wrap_model(self.make_model())
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.01))

    def build_training_data(self) -> Dataset:
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}


class SlowDataTrial(_Regression):
    def build_training_data(self) -> Dataset:
        return SlowDataset(512, self.context.get_hparam("load_seconds"))


class _Wide(nn.Module):
    """Few FLOPs, many parameters: a huge vector touched by one cheap reduction."""

    def __init__(self, params: int) -> None:
        super().__init__()
        self.head = nn.Linear(8, 1)
        self.wide = nn.Parameter(torch.zeros(params))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) + 1e-6 * self.wide.sum()


class WideTrial(_Regression):
    def make_model(self) -> nn.Module:
        return _Wide(self.context.get_hparam("wide_params"))


class StragglerTrial(_Regression):
    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        if self.context.rank == self.context.get_hparam("slow_rank"):
            time.sleep(self.context.get_hparam("sleep_seconds"))
        return super().train_batch(batch, epoch_idx, batch_idx)


class SlowBackwardTrial(_Regression):
    """One rank slow *inside* backward: a gradient hook that sleeps (a costly custom autograd op)."""

    def __init__(self, context: dtrain.TrialContext) -> None:
        super().__init__(context)
        if context.rank == context.get_hparam("slow_rank"):
            seconds = context.get_hparam("sleep_seconds")
            head = context.unwrap(self.model)[-1].weight  # computed first in backward, before any all-reduce

            def sleep(grad: torch.Tensor) -> torch.Tensor:
                time.sleep(seconds)
                return grad

            head.register_hook(sleep)


class SlowLoaderTrial(_Regression):
    """One rank's loader is slow (a slower disk or a busier host), the others' are not."""

    def build_training_data(self) -> Dataset:
        slow = self.context.rank == self.context.get_hparam("slow_rank")
        return SlowDataset(512, self.context.get_hparam("load_seconds") if slow else 0.0)


class PlainTrial(_Regression):
    """Nothing planted: with a tiny global batch, per-step costs (communication, optimizer) dominate."""
