"""Digits' MLP at hidden 960 with its middle layer frozen, as a fine-tuned model's backbone: 0.99M parameters,
of which 72k train. DDP exchanges only the trainable gradients (0.29 MB), which is what the planner must price."""

from __future__ import annotations

from typing import Any

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import dtrain


class FrozenMiddleTrial(dtrain.PyTorchTrial):
    def __init__(self, context: dtrain.TrialContext) -> None:
        super().__init__(context)
        hidden = context.get_hparam("hidden")
        net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                            nn.Linear(hidden, 10))
        for p in net[2].parameters():  # frozen before DDP wraps the model: DDP then buckets the others only
            p.requires_grad_(False)
        self.model = context.wrap_model(net)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = context.wrap_optimizer(torch.optim.SGD(trainable, lr=0.1, momentum=0.9))
        x, y = load_digits(return_X_y=True)
        self.data = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y, dtype=torch.long))
        self.loss_fn = nn.CrossEntropyLoss()

    def build_training_data(self) -> TensorDataset:
        return self.data

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        inputs, labels = batch
        loss = self.loss_fn(self.model(inputs), labels)
        self.context.backward(loss)
        self.context.step_optimizer(self.optimizer)
        return {"loss": loss}
