"""Digits (scikit-learn's 8x8 handwritten digits, shipped offline) with a small MLP."""

from __future__ import annotations

from typing import Any

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import dtrain


def digits_split(validation_fraction: float, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """A fixed train/validation split; pixels scaled from 0..16 to 0..1."""
    x, y = load_digits(return_X_y=True)
    inputs = torch.tensor(x, dtype=torch.float32) / 16.0
    labels = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(labels) * validation_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(inputs[train], labels[train]), TensorDataset(inputs[val], labels[val])


class DigitsTrial(dtrain.PyTorchTrial):
    def __init__(self, context: dtrain.TrialContext) -> None:
        super().__init__(context)
        hidden = context.get_hparam("hidden")
        self.model = context.wrap_model(nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10),
        ))
        self.optimizer = context.wrap_optimizer(torch.optim.SGD(
            self.model.parameters(), lr=context.get_hparam("lr"), momentum=context.get_hparam("momentum"),
        ))
        self.train_set, self.val_set = digits_split(context.get_hparam("validation_fraction"))
        self.loss_fn = nn.CrossEntropyLoss()

    def build_training_data(self) -> TensorDataset:
        return self.train_set

    def build_validation_data(self) -> TensorDataset:
        return self.val_set

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        inputs, labels = batch
        loss = self.loss_fn(self.model(inputs), labels)
        self.context.backward(loss)
        self.context.step_optimizer(self.optimizer)
        return {"loss": loss}

    def evaluate_batch(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        inputs, labels = batch
        logits = self.model(inputs)
        return {
            "validation_loss": self.loss_fn(logits, labels),
            "accuracy": (logits.argmax(dim=1) == labels).float().mean(),
        }
