"""``ddp``: PyTorch DistributedDataParallel, bucketed all-reduce overlapped with backward.

Gradient compression is a DDP comm hook; the bucket size is ``optimizations.tensor_fusion_threshold``
(Horovod's "tensor fusion"), optionally auto-tuned, which needs rebuilding DDP with another bucket size:
:class:`RebuildableDDP` makes that possible without the trial noticing (it keeps its reference to the
wrapped model). Timing is attached by the profiler (``self.timing``), not done here.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain.profiling.comm import NULL_RECORDER, CommRecorder
from dtrain.sync.base import SyncStrategy
from dtrain.sync.compression import COMPRESSORS, CompressionHookState, compressed_allreduce_hook
from dtrain.sync.powersgd import PowerSGDState, powersgd_hook
from dtrain.sync.registry import register

if TYPE_CHECKING:
    from dtrain.profiling.comm import DDPTiming
    from dtrain.sync.options import PowerSGDOptions, StrategyConfig

# dtrain.init()'s bucket size: torch's default.
DEFAULT_BUCKET_MB = 25.0


class RebuildableDDP(nn.Module):
    """A DDP whose bucket size can change mid-run: forwards to a DDP it can rebuild.

    The DDP is kept out of the module tree (in a list) so that ``state_dict`` and ``parameters`` are
    those of the user's module, exactly once.
    """

    def __init__(self, module: nn.Module, build: Any, bucket_cap_mb: float) -> None:
        super().__init__()
        self.module = module
        self._build = build
        self._ddp: list[DistributedDataParallel] = [build(module, bucket_cap_mb)]

    @property
    def ddp(self) -> DistributedDataParallel:
        return self._ddp[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def rebuild(self, bucket_cap_mb: float) -> None:
        # The old DDP's reducer must be gone (its autograd hooks removed) before the new one hooks the same
        # parameters, or gradients would be all-reduced twice.
        self._ddp.clear()
        gc.collect()
        self._ddp.append(self._build(self.module, bucket_cap_mb))


@register
class DDPStrategy(SyncStrategy):
    name = "ddp"
    compressions = frozenset({"none", "fp16", "bf16", "powersgd"})
    tunable_fusion = True
    one_slot_stand_in = "single_device"

    def __init__(self, device: torch.device, bucket_cap_mb: float = DEFAULT_BUCKET_MB, compression: str = "none",
                 powersgd: PowerSGDOptions | None = None, recorder: CommRecorder = NULL_RECORDER,
                 rebuildable: bool = False, seed: int = 0) -> None:
        super().__init__(device, recorder)
        from dtrain.sync.options import PowerSGDOptions

        self.bucket_cap_mb = bucket_cap_mb
        self.compression = compression
        self.powersgd_options = powersgd or PowerSGDOptions()
        self.rebuildable = rebuildable
        self.seed = seed
        self.powersgd_states: list[PowerSGDState] = []
        # Set by the profiler before models are wrapped: times the DDPs that have no hook of their own.
        self.timing: DDPTiming | None = None
        self._pending_state: list[dict[str, Any]] = []

    @classmethod
    def from_config(cls, config: StrategyConfig | None, device: torch.device,
                    recorder: CommRecorder = NULL_RECORDER) -> DDPStrategy:
        if config is None:
            return cls(device, recorder=recorder)
        o = config.optimizations
        return cls(device, bucket_cap_mb=o.tensor_fusion_threshold, compression=o.gradient_compression,
                   powersgd=o.powersgd, recorder=recorder, rebuildable=o.auto_tune_tensor_fusion, seed=config.seed)

    @property
    def fusion_threshold_mb(self) -> float:
        return self.bucket_cap_mb

    def setup_model(self, model: nn.Module) -> nn.Module:
        # A world of one never gets here from the registry: it builds the single-device strategy instead
        # (DDP would still copy every gradient through a one-process all-reduce).
        model = model.to(self.device)
        if self.rebuildable:
            return RebuildableDDP(model, self._build_ddp, self.bucket_cap_mb)
        return self._build_ddp(model, self.bucket_cap_mb)

    def _build_ddp(self, model: nn.Module, bucket_cap_mb: float) -> DistributedDataParallel:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers at construction, so replicas start identical
        # even if a trial forgot to seed its initialisation.
        ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)
        if self.compression == "none":
            if self.timing is not None:
                self.timing.attach(ddp, model)
            return ddp
        if self.compression == "powersgd":
            ddp.register_comm_hook(self._powersgd_state(model), powersgd_hook)
        else:
            ddp.register_comm_hook(CompressionHookState(COMPRESSORS[self.compression], self.recorder),
                                   compressed_allreduce_hook)
        if self.timing is not None and self.device.type == "cuda":
            # On CPU the hook's own stamps split backward from the wait; on CUDA only the last gradient can.
            self.timing.attach_grad_ready(ddp, model)
        return ddp

    def _powersgd_state(self, model: nn.Module) -> PowerSGDState:
        for state in self.powersgd_states:  # a rebuilt DDP keeps its model's compression memory
            if state.param_index == {id(p): i for i, p in enumerate(model.parameters())}:
                return state
        o = self.powersgd_options
        state = PowerSGDState(model, o.rank, o.start_iteration, o.error_feedback, o.warm_start, self.seed,
                              self.recorder)
        if self._pending_state:
            state.load_state_dict(self._pending_state.pop(0), self.device)
        self.powersgd_states.append(state)
        return state

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, (DistributedDataParallel, RebuildableDDP)) else model

    def rebuild(self, model: nn.Module, bucket_cap_mb: float) -> None:
        """Re-bucket a model made by :meth:`setup_model` with ``rebuildable=True``."""
        if isinstance(model, RebuildableDDP):
            model.rebuild(bucket_cap_mb)
        self.bucket_cap_mb = bucket_cap_mb

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        inner = model.ddp if isinstance(model, RebuildableDDP) else model
        if isinstance(inner, DistributedDataParallel):
            with inner.no_sync():
                yield
        else:
            yield

    def state_dict(self) -> dict[str, Any]:
        """Per-rank: PowerSGD's Q matrices and error-feedback buffers (they differ between ranks)."""
        return {"powersgd": [s.state_dict() for s in self.powersgd_states]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = list(state.get("powersgd", []))
        for live, data in zip(self.powersgd_states, saved, strict=False):
            live.load_state_dict(data, self.device)
        self._pending_state = saved[len(self.powersgd_states):]
