"""A tiny trial for tests: an MLP regression on synthetic data, with knobs to plant failures."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import dtrain


def synthetic(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class TinyTrial(dtrain.PyTorchTrial):
    def __init__(self, context: dtrain.TrialContext) -> None:
        super().__init__(context)
        hp = context.get_hparams()
        hidden = hp.get("hidden", 16)
        # Extra hidden layers (none by default) make the step device-bound for GPU timing tests.
        extra = [m for _ in range(hp.get("extra_layers", 0)) for m in (nn.Linear(hidden, hidden), nn.Tanh())]
        self.model = context.wrap_model(nn.Sequential(
            nn.Linear(8, hidden), nn.Tanh(), nn.Dropout(hp.get("dropout", 0.0)), *extra, nn.Linear(hidden, 1)))
        self.optimizer = context.wrap_optimizer(
            torch.optim.SGD(self.model.parameters(), lr=hp.get("lr", 0.05), momentum=0.9))
        self.hp = hp

    def build_training_data(self) -> TensorDataset:
        return synthetic(self.hp.get("train_size", 256), seed=1)

    def build_validation_data(self) -> TensorDataset | None:
        size = self.hp.get("val_size", 61)
        return synthetic(size, seed=2) if size else None

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        self._maybe_fail(batch_idx)
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        if self.hp.get("nan_at_batch") == batch_idx and self.hp.get("crash_rank", 1) == self.context.rank:
            loss = loss * float("nan")
        self.context.backward(loss)
        self.context.step_optimizer(self.optimizer)
        return {"loss": loss}

    def evaluate_batch(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        return {"mse": nn.functional.mse_loss(self.model(x), y)}

    def _maybe_fail(self, batch_idx: int) -> None:
        hp, rank = self.hp, self.context.rank
        if hp.get("crash_at_batch") == batch_idx and hp.get("crash_rank", 1) == rank:
            marker = hp.get("crash_once_marker")
            if marker is None or not Path(marker).exists():
                if marker is not None:
                    Path(marker).write_text("crashed")
                raise RuntimeError(f"planted failure at batch {batch_idx}")
        if hp.get("die_at_batch") == batch_idx and hp.get("crash_rank", 1) == rank:
            os._exit(17)
        if hp.get("sleep_rank") == rank and hp.get("sleep_at_batch") in (None, batch_idx) and (
                hp.get("sleep_while") is None or Path(hp["sleep_while"]).exists()):
            # every batch, or only at sleep_at_batch; with sleep_while, only while the test's file exists
            time.sleep(hp.get("sleep_seconds", 0.0))
        if hp.get("hold_at_batch") == batch_idx and hp.get("hold_lr", hp.get("lr")) == hp.get("lr"):
            _hold_until_stop_requested(Path(hp["hold_file"]))
        if hp.get("freeze_at_batch") == batch_idx and hp.get("crash_rank", 1) == rank:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen, as by a debugger or `kill -STOP`
        if hp.get("kill_at_batch") == batch_idx and hp.get("crash_rank", 1) == rank:
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does


def _hold_until_stop_requested(while_exists: Path, limit: float = 120.0) -> None:
    """While the test's file exists, wait (as a slow batch would) until the launcher asked this rank to stop:
    the test's signal then always lands mid-run, however loaded the machine is; the test removes the file
    before it resumes. Fails after ``limit`` seconds rather than hang."""
    from dtrain.engine.watchdog import STOP

    deadline = time.monotonic() + limit
    while while_exists.exists() and not STOP.requested:
        if time.monotonic() > deadline:
            raise RuntimeError(f"hold_at_batch: no stop request within {limit:.0f} s")
        time.sleep(0.02)


class NotATrial:
    pass


class Unfinished(dtrain.PyTorchTrial):  # no train_batch: found before any worker starts
    def build_training_data(self):
        return None
