"""The engine's side of the end-of-run figures: a finished trainer as :class:`dtrain.profiling.runfacts.RunFacts`.

Profiling sits below the engine and reads only that record; this module is where the engine says what a
run was (the config's pieces, the context's facts, the strategy's capabilities, the trainer's counts) and
hands the probes the trial's own step (:class:`dtrain.profiling.runfacts.ProbeHooks`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from torch.utils.data import DataLoader

from dtrain.config.schema import ExperimentConfig
from dtrain.engine.context import TrialContext
from dtrain.engine.trial import PyTorchTrial
from dtrain.engine.watchdog import STOP
from dtrain.profiling.record import MembershipChange
from dtrain.profiling.runfacts import ProbeHooks, RunFacts, StrategyFacts


class FinishedTrainer(Protocol):
    """What :func:`run_facts` reads of :class:`dtrain.engine.trainer.Trainer` at the end of its run."""

    ctx: TrialContext
    trial: PyTorchTrial
    config: ExperimentConfig
    loader: DataLoader[object]
    run_dir: Path
    per_slot: int
    global_batch: int
    steps: int
    train_seconds: float
    validation_seconds: float
    checkpoint_seconds: float
    unobserved_phases: list[str]
    resumed_at: int


def _optimizer_name(ctx: TrialContext) -> str | None:
    if not ctx.optimizers:
        return None
    first = ctx.optimizers[0]
    return type(getattr(first, "optim", first)).__name__  # a wrapping optimizer: the one it wraps


def run_facts(trainer: FinishedTrainer, wall_seconds: float,
              membership_changes: list[MembershipChange] | None = None) -> RunFacts:
    """The finished run as profiling needs it; ``membership_changes``: an elastic job's, in order."""
    ctx, config = trainer.ctx, trainer.config
    strategy, options = ctx.strategy, config.optimizations
    return RunFacts(
        device=ctx.device, backend=ctx.backend, precision=ctx.precision.name, threads_per_slot=ctx.num_threads,
        is_chief=ctx.is_chief, local_ranks=ctx.env.local_world_size,
        strategy=StrategyFacts(
            name=strategy.name, dp_world=strategy.dp_world, dp_rank=strategy.dp_rank, dp_group=strategy.dp_group,
            has_server_ranks=strategy.has_server_ranks, forward_needs_every_rank=strategy.forward_needs_every_rank,
            comm_measured=strategy.comm_measured, exchange=strategy.exchange, compressions=strategy.compressions,
            fusion_threshold_mb=strategy.fusion_threshold_mb),
        models=tuple(ctx.models), optimizers=tuple(ctx.optimizers), optimizer_name=_optimizer_name(ctx),
        timer=ctx.timer, hyperparameters=config.hyperparameters, global_batch_size=trainer.global_batch,
        per_slot_batch_size=trainer.per_slot, aggregation_frequency=options.aggregation_frequency,
        gradient_compression=options.gradient_compression, powersgd_rank=options.powersgd.rank,
        synthetic_data=config.data_loader.synthetic, data_loader_workers=config.data_loader.num_workers,
        steps=trainer.steps, train_seconds=trainer.train_seconds, validation_seconds=trainer.validation_seconds,
        checkpoint_seconds=trainer.checkpoint_seconds, wall_seconds=wall_seconds,
        resumed_at_batch=trainer.resumed_at, unobserved_phases=tuple(trainer.unobserved_phases),
        membership_changes=tuple(membership_changes or ()), probes=config.profiling.probes,
        stop_requested=lambda: STOP.requested,
        probe=ProbeHooks(train_batch=trainer.trial.train_batch, to_device=ctx.to_device,
                         gradient_sync=ctx.gradient_sync, loader=trainer.loader, precision=ctx.precision))
