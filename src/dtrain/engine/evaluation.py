"""Validation passes of the Trial loop: the trial's loader, built once, and one pass over it.

* ``evaluate_batch`` (the usual way): every slot evaluates its shard; metrics are weighted by the records
  of each batch (``trial.get_batch_length``) and reduced exactly over every slot.
* ``evaluate_full_dataset`` (Determined's other way, selected by overriding it): the first slot alone runs it
  over an unsharded loader while the other slots wait; its metrics are then broadcast so that every slot
  (its callbacks, the summary) sees the same numbers. The other slots wait in that broadcast, so the
  evaluation must end within ``resources.collective_timeout_seconds``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from dtrain import dist as ddist
from dtrain.engine import data
from dtrain.engine.context import TrialContext
from dtrain.engine.metrics import MeanAccumulator, checked_metrics
from dtrain.engine.trial import PyTorchTrial
from dtrain.engine.watchdog import STATUS
from dtrain.errors import UserError
from dtrain.sync.ddp import RebuildableDDP


def evaluates_full_dataset(trial: PyTorchTrial) -> bool:
    """Whether the trial overrides ``evaluate_full_dataset`` (then it validates that way)."""
    return type(trial).evaluate_full_dataset is not PyTorchTrial.evaluate_full_dataset


class Validation:
    """The trial's validation data as a loader, and :meth:`run`, one pass over it (a collective)."""

    def __init__(self, trial: PyTorchTrial, context: TrialContext, dataset: Dataset | None, per_slot: int,
                 options: dict[str, Any]) -> None:
        self.trial, self.ctx = trial, context
        self.enabled = dataset is not None
        self.full = self.enabled and evaluates_full_dataset(trial)
        self.loader: DataLoader | None = None
        if not self.enabled:
            return
        if not self.full:
            self.loader = context.loader(dataset, per_slot, split="eval", **options)  # type: ignore[arg-type]
            return
        if context.strategy.forward_needs_every_rank:
            raise UserError("evaluate_full_dataset runs the model on one slot, which FSDP's sharded forward cannot "
                            "(every slot takes part in it): use evaluate_batch, or another sync.strategy")
        if context.is_chief:  # the others only wait for its metrics
            options = {"pin_memory": context.device.type == "cuda", **options}
            self.loader = data.eval_loader(dataset, per_slot, 0, 1, **options)  # type: ignore[arg-type]

    def run(self) -> dict[str, float]:
        """Evaluate with every model in eval mode and no gradients; the metrics, the same on every slot."""
        models = self.ctx.models
        for model in models:
            model.eval()
        try:
            with torch.no_grad():
                return self._full() if self.full else self._batches()
        finally:
            for model in models:
                model.train()

    def _batches(self) -> dict[str, float]:
        acc = MeanAccumulator()
        evaluate, length, to_device = self.trial.evaluate_batch, self.trial.get_batch_length, self.ctx.to_device
        for i, batch in enumerate(self.loader):  # type: ignore[arg-type]
            # Exact: sums over records, not a mean of the batches' means.
            acc.add(evaluate(to_device(batch), i), weight=length(batch))
        return acc.global_means(self.ctx.strategy.dp_group)

    def _full(self) -> dict[str, float]:
        # A DDP model that trained (or never ran) would broadcast its buffers at its next forward: a collective
        # the waiting slots never join. Every slot skips that one broadcast alike (DDP skips it after any
        # gradient-free forward too); the next training step's forward syncs them as usual.
        for model in self.ctx.models:
            inner = model.ddp if isinstance(model, RebuildableDDP) else model
            if isinstance(inner, DistributedDataParallel):
                inner.require_forward_param_sync = False
        box: list[dict[str, float] | None] = [None]
        if self.loader is not None:
            STATUS.enter("validation (evaluate_full_dataset)")
            metrics = self.trial.evaluate_full_dataset(self.loader)
            if not isinstance(metrics, Mapping):
                raise UserError(f"evaluate_full_dataset returned a {type(metrics).__name__}; return a dict of "
                                "scalar metrics, e.g. {'accuracy': acc}")
            box[0] = {name: float(value) for name, value in checked_metrics(metrics).items()}
        group = self.ctx.strategy.dp_group
        if ddist.is_distributed(group):
            STATUS.enter("validation (waiting for rank 0's evaluate_full_dataset)")
            dist.broadcast_object_list(box, src=0, group=group)
        return dict(box[0] or {})
