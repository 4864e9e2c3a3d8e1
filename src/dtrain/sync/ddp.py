"""``ddp``: PyTorch DistributedDataParallel, bucketed all-reduce overlapped with backward.

Gradient compression and the profiler's timing are DDP comm hooks; the bucket size is
``optimizations.tensor_fusion_threshold`` (Horovod's "tensor fusion"), optionally auto-tuned, which needs
rebuilding DDP with another bucket size: :class:`RebuildableDDP` makes that possible without the trial
noticing (it keeps its reference to the wrapped model).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain.config import PowerSGDOptions
from dtrain.profiler import CommRecorder, timed_allreduce_hook
from dtrain.sync.base import SyncStrategy
from dtrain.sync.compression import COMPRESSORS, CompressionHookState, compressed_allreduce_hook
from dtrain.sync.powersgd import PowerSGDState, powersgd_hook

# DDP's reducer times one iteration in this many (plus its first ten).
NATIVE_SAMPLE_RATE = 10


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


class DDPStrategy(SyncStrategy):
    name = "ddp"

    def __init__(self, device: torch.device, bucket_cap_mb: float, compression: str = "none",
                 powersgd: PowerSGDOptions | None = None, recorder: CommRecorder | None = None,
                 rebuildable: bool = False, seed: int = 0, native_timing: bool = True) -> None:
        super().__init__(device, recorder)
        self.bucket_cap_mb = bucket_cap_mb
        self.compression = compression
        self.powersgd_options = powersgd or PowerSGDOptions()
        self.rebuildable = rebuildable
        self.seed = seed
        self.powersgd_states: list[PowerSGDState] = []
        # Aggregation needs per-step stamps (DDP's timers only see synchronizing iterations).
        self.native_timing = native_timing
        self._timed_ddps: list[DistributedDataParallel] = []
        self._stamped: set[int] = set()
        self._models: list[nn.Module] = []
        self._pending_state: list[dict[str, Any]] = []

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            # One slot: nothing to synchronize. Plain training is the honest baseline that N slots are
            # compared with (DDP would still copy every gradient through a one-process all-reduce).
            return model
        wrapped = (RebuildableDDP(model, self._build_ddp, self.bucket_cap_mb) if self.rebuildable
                   else self._build_ddp(model, self.bucket_cap_mb))
        self._models.append(wrapped)
        return wrapped

    def _build_ddp(self, model: nn.Module, bucket_cap_mb: float) -> DistributedDataParallel:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers at construction, so replicas start identical
        # even if a trial forgot to seed its initialisation.
        ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)
        self._register_hook(ddp, model)
        return ddp

    def _register_hook(self, ddp: DistributedDataParallel, model: nn.Module) -> None:
        if self.recorder is not None and self.compression == "none" and self.native_timing:
            self._use_native_timing(ddp)
        elif self.compression == "powersgd":
            state = self._powersgd_state(model)
            ddp.register_comm_hook(state, powersgd_hook)
        elif self.compression != "none":
            ddp.register_comm_hook(CompressionHookState(COMPRESSORS[self.compression], self.recorder),
                                   compressed_allreduce_hook)
        elif self.recorder is not None:
            # DDP's default all-reduce, as a hook that lets the profiler see each bucket start and finish.
            ddp.register_comm_hook(self.recorder, timed_allreduce_hook)

    def _use_native_timing(self, ddp: DistributedDataParallel) -> None:
        """Time DDP's all-reduce with its reducer's own timers instead of a Python comm hook.

        A Python hook must complete a Python future on Gloo's thread for every bucket: on a 2 ms step that
        costs several percent of throughput (bench/profiler_overhead.py). DDP's C++ reducer already times
        all-reduce busy time on sampled iterations; reading its averages costs nothing per step. Exposed
        time is measured per step from the last gradient's autograd hook (main thread) instead. Private
        torch API (stable since 1.9): on failure, fall back to the hook.
        """
        try:
            ddp._set_ddp_runtime_logging_sample_rate(NATIVE_SAMPLE_RATE)
        except (AttributeError, RuntimeError):
            ddp.register_comm_hook(self.recorder, timed_allreduce_hook)
            return
        self._timed_ddps = [*[d for d in self._timed_ddps if d is not ddp][-8:], ddp]
        self.recorder.native = self._native_stats  # type: ignore[union-attr]
        self._stamp_last_gradient(ddp.module)

    def _stamp_last_gradient(self, model: nn.Module) -> None:
        """Stamp when backward computes its last gradient: autograd runs in reverse, so the model's first
        parameters are normally last. A hook on the first few (main thread, ~1 us each) is enough."""
        if id(model) in self._stamped:
            return  # a rebuilt DDP around the same module: hooks are already there
        self._stamped.add(id(model))
        for param in [p for p in model.parameters() if p.requires_grad][:4]:
            param.register_post_accumulate_grad_hook(self.recorder.mark_grad_ready)  # type: ignore[union-attr]

    def _native_stats(self) -> dict[str, float] | None:
        live = [d for d in self._timed_ddps if d in self._current_ddps()]
        if not live:
            return None
        stats = {"busy": 0.0, "bytes": 0.0, "buckets": 0.0}
        for ddp in live:
            data = ddp._get_ddp_logging_data()
            if not data.get("avg_backward_comm_time"):
                return None  # no sampled iteration yet
            stats["busy"] += data["avg_backward_comm_time"] / 1e9
            sizes = [int(x) for x in str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")).split(",")
                     if x.strip()]
            stats["bytes"] += float(sum(sizes))
            stats["buckets"] += float(len(sizes))
        return stats

    def _current_ddps(self) -> list[DistributedDataParallel]:
        return [m.ddp if isinstance(m, RebuildableDDP) else m for m in self._models
                if isinstance(m, (RebuildableDDP, DistributedDataParallel))]

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
