"""What the end-of-run figures and probes need from a run, handed down by the engine.

Profiling sits below the strategies and the engine (docs/architecture.md): it must not read the trainer, the
context or the config. At the end of a run the engine (:mod:`dtrain.engine.runfacts`) fills a
:class:`RunFacts`: the config's pieces, the context's facts, the strategy's capabilities, the trainer's
counts, and (:class:`ProbeHooks`) the few calls the probes run: the trial's own ``train_batch`` on the
run's device, without exchanging gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.data import DataLoader

from dtrain.profiling.record import MembershipChange
from dtrain.profiling.timer import StepTimer


class SwitchablePrecision(Protocol):
    """The run's precision as the probes see it: its name, and the autocast dtype its wrapped forwards read
    at each call (``None``: no autocast), which the model-step probe sets for a moment."""

    name: str
    dtype: torch.dtype | None


@dataclass(frozen=True)
class StrategyFacts:
    """The strategy's name, its place in the data-parallel group and the capabilities profiling reads."""

    name: str
    dp_world: int
    dp_rank: int
    dp_group: ProcessGroup | None
    has_server_ranks: bool
    forward_needs_every_rank: bool
    comm_measured: bool
    exchange: str  # how replicas talk (dtrain.sync.base.SyncStrategy.exchange)
    compressions: frozenset[str]
    fusion_threshold_mb: float | None


@dataclass(frozen=True)
class ProbeHooks:
    """What the end-of-run probes run: the trial's step, batches moved to the device, gradient exchange
    switched off (``gradient_sync(False)``: forward and backward only), the training loader's dataset and
    collate function, and the run's precision."""

    train_batch: Callable[[object, int, int], object]
    to_device: Callable[[object], object]
    gradient_sync: Callable[[bool], AbstractContextManager[object]]
    loader: DataLoader[object]
    precision: SwitchablePrecision


@dataclass(frozen=True)
class RunFacts:
    """A finished run, as profiling needs it (see the module's docstring)."""

    # Where and how it ran.
    device: torch.device
    backend: str
    precision: str
    threads_per_slot: int
    is_chief: bool
    local_ranks: int  # processes of the job on this host (they share its memory)
    strategy: StrategyFacts
    models: tuple[nn.Module, ...]
    optimizers: tuple[torch.optim.Optimizer, ...]
    optimizer_name: str | None
    timer: StepTimer
    # The config's pieces.
    hyperparameters: Mapping[str, object]
    global_batch_size: int
    per_slot_batch_size: int
    aggregation_frequency: int
    gradient_compression: str
    powersgd_rank: int
    synthetic_data: bool
    data_loader_workers: int
    # How far it went.
    steps: int
    train_seconds: float
    validation_seconds: float
    checkpoint_seconds: float
    wall_seconds: float
    resumed_at_batch: int
    # Phases train_batch left unmarked (dtrain.engine.firstbatch): their time is in "other".
    unobserved_phases: tuple[str, ...] = ()
    # An elastic job's joins and leaves so far (dtrain.launcher.membership).
    membership_changes: tuple[MembershipChange, ...] = ()
    probe: ProbeHooks | None = None
    # profiling.probes: the end-of-run probes run (the FLOP count, for MFU, runs either way).
    probes: bool = True
    # Whether this rank was asked to stop (Ctrl-C, SIGTERM: dtrain.engine.watchdog.STOP): the probes left then
    # are skipped on every rank.
    stop_requested: Callable[[], bool] = lambda: False
