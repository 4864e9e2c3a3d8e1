"""A Trial with nothing to compute, for bench/loop_cost.py: what is left per step is dtrain's own work."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

import dtrain


class NoOpStep(dtrain.LoopCallback):
    """Overrides the per-step hook with nothing: the loop's cost of calling it."""

    def on_step_end(self, batch_idx: int) -> None:
        pass


class ConstantTrial(dtrain.PyTorchTrial):
    """Returns a constant CPU loss; its one-parameter model and optimizer exist because a Trial needs them
    (checkpoints), and are never stepped. Hyperparameter ``step_callback``: add :class:`NoOpStep`."""

    def __init__(self, context: dtrain.TrialContext) -> None:
        super().__init__(context)
        self.loss = torch.tensor(0.5)
        self.model = context.wrap_model(torch.nn.Linear(1, 1))
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.0))

    def build_training_data(self) -> Any:
        return TensorDataset(torch.zeros(1 << 17, 1))  # one epoch: no loader restarts

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        return {"loss": self.loss}

    def build_callbacks(self) -> dict[str, dtrain.LoopCallback]:
        return {"noop": NoOpStep()} if self.context.get_hparams().get("step_callback") else {}
