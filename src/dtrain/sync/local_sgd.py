"""``local_sgd``: each slot steps on its own gradients; weights are averaged every ``period`` steps, after
``warmup_steps`` fully synchronous steps (gradients averaged as in ``allreduce``).

Averaging uses torch's ``PeriodicModelAverager`` (the reference for post-local SGD). Between averagings
the replicas differ, and so do the optimizers' states (momentum): checkpoints keep each rank's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from dtrain.profiling.comm import NULL_RECORDER, CommRecorder
from dtrain.sync.allreduce import AllReduceStrategy
from dtrain.sync.options import DEFAULT_FUSION_MB, LocalSGDOptions
from dtrain.sync.registry import register

if TYPE_CHECKING:
    from dtrain.sync.options import StrategyConfig


@register
class LocalSGDStrategy(AllReduceStrategy):
    name = "local_sgd"
    exchanges_in_step = True
    replicas_may_differ = True
    per_rank_optimizer_state = True
    one_slot_stand_in = None  # its checkpoints keep each rank's own state, at one slot too

    def __init__(self, device: torch.device, period: int, warmup_steps: int, bucket_cap_mb: float,
                 compression: str = "none", recorder: CommRecorder = NULL_RECORDER) -> None:
        super().__init__(device, bucket_cap_mb, compression, recorder)
        self.warmup_steps = warmup_steps
        self.averager = PeriodicModelAverager(period=period, warmup_steps=warmup_steps) if self.world > 1 else None
        self.steps = 0
        self.averaged_last_step = False

    @classmethod
    def from_config(cls, config: StrategyConfig | None, device: torch.device,
                    recorder: CommRecorder = NULL_RECORDER) -> LocalSGDStrategy:
        if config is None:  # dtrain.init(): the options' defaults, uncompressed, the default fusion
            opts = LocalSGDOptions()
            return cls(device, opts.period, opts.warmup_steps, DEFAULT_FUSION_MB, "none", recorder)
        o, opts = config.optimizations, config.sync.local_sgd
        return cls(device, opts.period, opts.warmup_steps, o.tensor_fusion_threshold, o.gradient_compression,
                   recorder)

    def exchange_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.steps < self.warmup_steps:  # synchronous warm-up: gradients averaged as in allreduce
            super().exchange_gradients(optimizer)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.steps += 1
        if self.averager is None:
            return
        before = self.averager.step
        period, warmup = self.averager.period, self.averager.warmup_steps
        self.averaged_last_step = before >= warmup and (before - warmup) % period == 0
        self.averager.average_parameters(optimizer.param_groups)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "averager_step": self.averager.step if self.averager else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))
        if self.averager is not None:
            self.averager.step = int(state.get("averager_step", 0))
