"""A trial written against Determined's PyTorch API, two import lines changed, for tests/determined.

Per-slot batch sizes in its loaders, a one-argument evaluate_batch, a stateful callback, a scheduler stepped
per epoch, the data config, gradient clipping through clip_grads, and knobs to plant a crash.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import dtrain.determined as det  # was: import determined as det
from dtrain.determined import pytorch  # was: from determined import pytorch


def synthetic(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


class Counter(pytorch.PyTorchCallback):
    """Counts epochs and validations (state that must survive a resume); notes where checkpoints land."""

    def __init__(self, out: str | None, rank: int) -> None:
        self.epochs = self.validations = 0
        self.out, self.rank = out, rank

    def on_training_epoch_end(self, epoch_idx: int) -> None:
        self.epochs += 1

    def on_validation_end(self, metrics: dict[str, Any]) -> None:
        self.validations += 1

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:  # Determined: on the chief only
        if self.out:
            with open(Path(self.out) / f"written.rank{self.rank}", "a") as f:
                f.write(f"{Path(checkpoint_dir).name}\n")

    def on_checkpoint_upload_end(self, uuid: str) -> None:  # every rank
        if self.out:
            with open(Path(self.out) / f"uploaded.rank{self.rank}", "a") as f:
                f.write(f"{Path(uuid).name}\n")

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": self.epochs, "validations": self.validations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epochs, self.validations = state_dict["epochs"], state_dict["validations"]


class DetMLP(pytorch.PyTorchTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        self.hp = context.get_hparams()
        self.train_size = context.get_data_config().get("train_size", 128)
        hidden = self.hp.get("hidden", 16)
        self.model = context.wrap_model(nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1)))
        self.optimizer = context.wrap_optimizer(
            torch.optim.SGD(self.model.parameters(), lr=self.hp.get("lr", 0.05), momentum=0.9))
        self.scheduler = context.wrap_lr_scheduler(
            torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.7),
            step_mode=pytorch.LRScheduler.StepMode.STEP_EVERY_EPOCH)
        self.counter = Counter(self.hp.get("out"), context.distributed.get_rank())

    def build_training_data_loader(self) -> pytorch.DataLoader:
        return pytorch.DataLoader(synthetic(self.train_size, 1), batch_size=self.context.get_per_slot_batch_size(),
                                  shuffle=True)

    def build_validation_data_loader(self) -> pytorch.DataLoader:
        return pytorch.DataLoader(synthetic(61, 2), batch_size=self.context.get_per_slot_batch_size())

    def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
        return {"counter": self.counter}

    def train_batch(self, batch: pytorch.TorchData, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        if self.hp.get("die_at_batch") == batch_idx and self.hp.get("crash_rank", 1) == self.context.rank:
            os._exit(17)  # as a killed worker
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.optimizer, clip_grads=lambda p: torch.nn.utils.clip_grad_norm_(p, 1.0))
        return {"loss": loss, "lr": self.scheduler.get_last_lr()[0], "epochs_counted": self.counter.epochs,
                "validations_counted": self.counter.validations}

    def evaluate_batch(self, batch: pytorch.TorchData) -> dict[str, Any]:  # Determined's one-argument form
        x, y = batch
        return {"mse": nn.functional.mse_loss(self.model(x), y)}


def main() -> None:
    """The Trainer API, as a Determined user runs it locally (here under dtrain launch, torchrun or python)."""
    import json
    import logging
    import sys

    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    assert det.get_cluster_info() is None
    settings = json.loads(sys.argv[1])
    with pytorch.init(hparams=settings["hparams"], exp_conf=settings["exp_conf"]) as context:
        trial = DetMLP(context)
        trainer = pytorch.Trainer(trial, context)
        trainer.fit(max_length=pytorch.Batch(settings["batches"]), validation_period=pytorch.Batch(8),
                    checkpoint_period=pytorch.Batch(8), reporting_period=pytorch.Batch(8))


if __name__ == "__main__":
    main()
