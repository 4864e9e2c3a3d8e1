"""A model of 200 small parameter tensors (10k floats each): where tensor fusion decides everything."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import dtrain


class ManySmall(nn.Module):
    def __init__(self, tensors: int, size: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(size) * 0.01) for _ in range(tensors))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Few FLOPs per parameter: a dot product of the input with each small tensor.
        return torch.stack([x @ w for w in self.weights], dim=1).sum(dim=1, keepdim=True)


class ManyTensorsTrial(dtrain.PyTorchTrial):
    def __init__(self, context: dtrain.TrialContext) -> None:
        super().__init__(context)
        size = context.get_hparam("tensor_size")
        self.model = context.wrap_model(ManySmall(context.get_hparam("tensors"), size))
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=1e-3))
        g = torch.Generator().manual_seed(0)
        # Inputs of unit norm: the 200 tensors act as one sum, so SGD's step on it is 200 x lr x |x|^2, which
        # unscaled inputs (|x|^2 = size) made diverge within 20 batches.
        x = torch.randn(4096, size, generator=g) / size**0.5
        self.data = TensorDataset(x, torch.randn(4096, 1, generator=g))

    def build_training_data(self) -> TensorDataset:
        return self.data

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}
