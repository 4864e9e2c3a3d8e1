"""Each strategy's options, and what a strategy may read of a run's config.

Torch-free, so that validating a config does not import torch; the config schema
(:mod:`dtrain.config.schema`) composes these models under ``optimizations.powersgd``,
``sync.local_sgd`` and ``sync.parameter_server``. Strategies never import the schema: they read the
config through :class:`StrategyConfig`, the few fields they use, which keeps ``sync`` below ``config``
with no import circle.
"""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import Field

from dtrain.config.bounds import MAX_SLOTS, MAX_STEPS, Strict


class PowerSGDOptions(Strict):
    """Options of ``gradient_compression: powersgd``."""

    # Rank of the low-rank approximation of each gradient matrix: bytes sent ~ rank x (rows + columns).
    rank: int = Field(default=2, ge=1, le=1024)
    # Steps of exact all-reduce before compressing (early gradients change fast and compress badly).
    start_iteration: int = Field(default=10, ge=0, le=MAX_STEPS)
    error_feedback: bool = True
    warm_start: bool = True


class LocalSGDOptions(Strict):
    # Average weights every `period` optimizer steps, after `warmup_steps` fully synchronous steps.
    period: int = Field(default=4, ge=1, le=MAX_STEPS)
    warmup_steps: int = Field(default=10, ge=0, le=MAX_STEPS)


class ParameterServerOptions(Strict):
    # Dedicated server ranks (the last ones); parameters are sharded across them.
    servers: int = Field(default=1, ge=1, le=MAX_SLOTS)
    # sync: every update averages all workers' gradients (equivalent to all-reduce SGD);
    # async: each worker's gradient is applied on arrival, no worker more than `staleness` updates behind.
    mode: Literal["sync", "async"] = "sync"
    staleness: int = Field(default=1, ge=0, le=MAX_STEPS)


class ResourcesView(Protocol):
    @property
    def slots_per_trial(self) -> int: ...


class OptimizationsView(Protocol):
    @property
    def gradient_compression(self) -> str: ...
    @property
    def tensor_fusion_threshold(self) -> float: ...
    @property
    def auto_tune_tensor_fusion(self) -> bool: ...
    @property
    def powersgd(self) -> PowerSGDOptions: ...
    @property
    def auto_tune_candidates_mb(self) -> list[float]: ...
    @property
    def auto_tune_warmup_steps(self) -> int: ...
    @property
    def auto_tune_steps_per_candidate(self) -> int: ...


class SyncView(Protocol):
    @property
    def strategy(self) -> str: ...
    @property
    def local_sgd(self) -> LocalSGDOptions: ...
    @property
    def parameter_server(self) -> ParameterServerOptions: ...


class StrategyConfig(Protocol):
    """What a strategy reads of the experiment config (:class:`dtrain.config.schema.ExperimentConfig`)."""

    @property
    def resources(self) -> ResourcesView: ...
    @property
    def optimizations(self) -> OptimizationsView: ...
    @property
    def sync(self) -> SyncView: ...
    @property
    def seed(self) -> int: ...


# ``dtrain.init()`` has no config: its DDP exchanges uncompressed gradients in buckets of this size (MB), the
# schema's default for optimizations.tensor_fusion_threshold.
DEFAULT_FUSION_MB = 64.0
