"""``single_device``: one slot, nothing to exchange: the model on its device, no wrapper, no buckets, no hooks.

What Lightning's ``SingleDeviceStrategy`` is to its DDP strategy. The registry picks it by itself in a world
of one for a strategy whose one-slot training is plain training (``one_slot_stand_in``: ``ddp`` and
``allreduce``), so that one slot runs the honest baseline that N slots are compared with. It then *stands
in* for the configured strategy: checkpoints, ``summary.json``, ``profile.json``, the doctor and
``dtrain plan`` (which predicts the configured strategy at other slot counts) see that strategy's name,
gradient compressions and fusion threshold, as a one-slot run always showed them. Other strategies keep
their own class at one slot: ``local_sgd``, ``fsdp`` and the parameter server keep state per rank in their
checkpoints, and a third-party strategy decides for itself.

Chosen by name (``sync.strategy: single_device``) it refuses more than one slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dtrain.profiling.comm import NULL_RECORDER, CommRecorder
from dtrain.sync.base import SyncStrategy
from dtrain.sync.registry import register

if TYPE_CHECKING:
    from dtrain.sync.options import StrategyConfig


@register
class SingleDeviceStrategy(SyncStrategy):
    name = "single_device"
    one_slot_only = True

    def __init__(self, device: torch.device, recorder: CommRecorder = NULL_RECORDER,
                 stands_for: SyncStrategy | None = None) -> None:
        super().__init__(device, recorder)
        self.stands_for = stands_for
        if stands_for is not None:
            # Instance attributes over the class's: what a run records is the configured strategy's.
            self.name = stands_for.name  # type: ignore[misc]
            self.compressions = stands_for.compressions  # type: ignore[misc]
            self.exchange = stands_for.exchange  # type: ignore[misc]

    @classmethod
    def from_config(cls, config: StrategyConfig | None, device: torch.device,
                    recorder: CommRecorder = NULL_RECORDER) -> SingleDeviceStrategy:
        return cls(device, recorder)

    @classmethod
    def standing_in(cls, configured: type[SyncStrategy], config: StrategyConfig | None, device: torch.device,
                    recorder: CommRecorder = NULL_RECORDER) -> SingleDeviceStrategy:
        """One slot of a run configured for ``configured``: trains plainly, reports as ``configured``."""
        # The configured strategy is built (nothing is wrapped until setup_model) only for what it reports.
        return cls(device, recorder, stands_for=configured.from_config(config, device))

    @classmethod
    def check_config(cls, config: StrategyConfig) -> None:
        super().check_config(config)
        slots = config.resources.slots_per_trial
        if slots > 1:
            raise ValueError(f"sync.strategy 'single_device' trains one slot, the config asks for {slots}; "
                             "use sync.strategy: ddp (one slot then trains this way by itself) or --slots 1")

    @property
    def fusion_threshold_mb(self) -> float | None:
        return self.stands_for.fusion_threshold_mb if self.stands_for is not None else None

    def setup_model(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)
