"""A bench workload (bench/models.py) as a PyTorchTrial: the same model, data and SGD step as the benches'
hand-written loops. Subclasses add what they measure in :meth:`WorkloadTrial.before_step`."""

from __future__ import annotations

from typing import Any

import torch
from models import loss_of, workload

import dtrain


class WorkloadTrial(dtrain.PyTorchTrial):
    """Hyperparameter ``model``: a name for :func:`models.workload`."""

    def __init__(self, context: dtrain.TrialContext) -> None:
        super().__init__(context)
        model, self.data, self.kind = workload(context.get_hparams()["model"])
        self.model = context.wrap_model(model)
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9))

    def build_training_data(self) -> Any:
        return self.data

    def before_step(self, batch_idx: int) -> None:
        """Called first in every ``train_batch``."""

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        self.before_step(batch_idx)
        x, y = batch
        loss = loss_of(self.kind, self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}
