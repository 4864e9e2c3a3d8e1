"""One rank's training state: what a checkpoint holds for it and how it is put back.

:class:`TrainingState` gathers the engine's live objects (strategy, wrapped models, optimizers,
schedulers, precision) and owns the rules for saving them and restoring them, including resuming on a
different slot count; :class:`PendingRestore` lets an own loop load a checkpoint before it wraps its model.
The files themselves (atomic commit, verification, data-only loading) are :mod:`dtrain.engine.checkpoint`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.engine.checkpoint import (
    CheckpointPayload,
    LoadedCheckpoint,
    _all_finite,
    load,
    resolve,
    rng_state,
    save,
    set_rng_state,
)
from dtrain.engine.precision import Precision
from dtrain.errors import CheckpointError
from dtrain.sync.base import SyncStrategy

log = logging.getLogger(__name__)


@dataclass
class Restored:
    """What a restore hands back to the loop: where it came from and the loop's own saved values."""

    path: Path
    extra: dict[str, Any]  # the chief's ``extra`` (the trainer's batch count, a user's epoch, ...)
    rank_extra: dict[str, Any] | None  # this rank's ``rank_extra``; None when the job's layout changed
    same_layout: bool


@dataclass
class TrainingState:
    """Everything a rank saves and restores, and the rules for it, in one place.

    The chief writes the full models (gathered from shards if need be), optimizers, schedulers, the
    precision's loss-scaler state and ``extra``; every rank writes its RNG streams, its strategy's state
    (e.g. PowerSGD error feedback) and ``rank_extra``, plus its own weights and optimizer state where the
    strategy lets those differ between ranks. Resuming on another slot count restores the shared state
    exactly; per-rank streams are then reseeded (only per-slot randomness, such as dropout, differs).
    """

    strategy: SyncStrategy
    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]  # the user's LR schedulers (torch's, or any with state_dict/load_state_dict)
    precision: Precision
    rank: int
    world_size: int

    def _optimizer_states(self) -> list[dict[str, Any]]:
        return [o.state_dict() for o in self.optimizers] + [s.state_dict() for s in self.schedulers]

    def save(self, directory: Path, batches: int, extra: dict[str, Any] | None = None, keep_last: int = 2,
             rank_extra: dict[str, Any] | None = None, optimizer_steps: int | None = None) -> Path:
        """Collective: every rank calls it. ``optimizer_steps``: the own-loop context's step count."""
        models = [self.strategy.model_state_dict(m) for m in self.models]  # may be collective (FSDP)
        payload = None
        if self.rank == 0:
            trainer_state: dict[str, Any] = {"extra": dict(extra or {})}
            if optimizer_steps is not None:
                trainer_state["optimizer_steps"] = optimizer_steps
            if self.precision is not None and self.precision.state_dict():
                trainer_state["precision"] = self.precision.state_dict()
            payload = CheckpointPayload(batches=batches, models=models, optimizers=self._optimizer_states(),
                                        trainer_state=trainer_state,
                                        metadata={"world_size": self.world_size, "strategy": self.strategy.name,
                                                  "finite": _all_finite(models)})
        rank_state: dict[str, Any] = {"batches": batches, "rng": rng_state(self.strategy.device),
                                      "extra": dict(rank_extra or {}), "strategy": self.strategy.state_dict()}
        if self.strategy.replicas_may_differ:
            rank_state["models"] = [self.strategy.unwrap(m).state_dict() for m in self.models]
        if self.strategy.per_rank_optimizer_state:
            rank_state["optimizers"] = self._optimizer_states()
        return save(directory, payload, rank_state, self.rank, keep_last)

    def restore(self, path: Path) -> Restored:
        """Load the checkpoint at ``path`` (a checkpoint folder, or a folder holding ``latest``) into the
        live objects."""
        pending = self.pending_restore(path)
        self._check_counts(pending.loaded, pending.path)
        pending.apply(self)
        return pending.restored

    def pending_restore(self, path: Path) -> PendingRestore:
        """Read and verify the checkpoint at ``path`` now; apply it (:meth:`PendingRestore.apply`) once the
        models and optimizers exist, which lets a loop load before it wraps them."""
        path = resolve(path)
        loaded = load(path, self.rank)
        saved_world = loaded.metadata.get("world_size")
        same_layout = (loaded.rank_state is not None and saved_world == self.world_size
                       and loaded.metadata.get("strategy", self.strategy.name) == self.strategy.name)
        rank_state = loaded.rank_state if same_layout and loaded.rank_state is not None else {}
        if self.strategy.per_rank_optimizer_state and "optimizers" not in rank_state:
            raise CheckpointError(f"checkpoint {path} has no optimizer state for rank {self.rank} of "
                                  f"{self.world_size} ({self.strategy.name} keeps it per rank); resume with "
                                  f"{saved_world} slots and the same sync.strategy")
        extra = dict(loaded.trainer_state.get("extra", {}))
        rank_extra = dict(rank_state.get("extra", {})) if same_layout else None
        return PendingRestore(path, loaded, rank_state, Restored(path, extra, rank_extra, same_layout))

    def _log_layout_change(self, path: Path, saved_world: object) -> None:
        """Say exactly what differs from an uninterrupted run when the slot count (or strategy) changed."""
        stochastic = sorted({type(m).__name__ for model in self.models for m in self.strategy.unwrap(model).modules()
                             if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0})
        head = (f"checkpoint {path} was written by {saved_world} slot(s), this job has {self.world_size}: weights, "
                "optimizer state and the data position (a global batch index: the same samples per global batch on "
                f"any slot count) are restored exactly, so training continues as an uninterrupted "
                f"{self.world_size}-slot run would, up to the order of floating-point sums; ")
        if stochastic:
            log.warning("%sonly the per-slot random streams are reseeded, so the model's %s layers draw "
                        "different masks than in that run", head, ", ".join(stochastic))
        else:
            log.info("%sthe per-slot random streams are reseeded, and this model has no layer that draws from "
                     "them (no dropout)", head)

    def _check_counts(self, loaded: LoadedCheckpoint, path: Path) -> None:
        if len(loaded.models) != len(self.models):
            raise CheckpointError(f"checkpoint {path} holds {len(loaded.models)} model(s) but this code wrapped "
                                  f"{len(self.models)}; resume with the same trial code")
        if len(loaded.optimizers) < len(self.optimizers):
            raise CheckpointError(f"checkpoint {path} holds {len(loaded.optimizers)} optimizer state(s) but this "
                                  f"code wrapped {len(self.optimizers)}; resume with the same trial code")


@dataclass
class PendingRestore:
    """A checkpoint read and verified, applied to models, optimizers and schedulers as they get wrapped.

    Per-rank state (RNG streams, the strategy's state, the loss scaler) is applied once every saved model
    is in place: a loop that loads before building its model would otherwise draw that model's
    initialisation from the restored RNG streams and shift every later draw.
    """

    path: Path
    loaded: LoadedCheckpoint
    rank_state: dict[str, Any]
    restored: Restored
    models_done: int = 0
    optimizers_done: int = 0
    schedulers_done: int = 0
    rank_state_done: bool = False

    def missing(self) -> str | None:
        """What the loop has not wrapped yet that the checkpoint holds, or None once it is all applied."""
        n_models = len(self.rank_state.get("models", self.loaded.models))
        if self.models_done < n_models:
            return f"{n_models} model(s), {self.models_done} wrapped"
        if self.loaded.optimizers and not self.optimizers_done:
            return "optimizer state, no optimizer wrapped"
        return None

    def apply(self, state: TrainingState) -> None:
        """Apply what ``state`` now has room for (call again after wrapping more)."""
        model_states = self.rank_state.get("models", self.loaded.models)
        if len(state.models) > len(model_states):
            raise CheckpointError(f"checkpoint {self.path} holds {len(model_states)} model(s) but this code wrapped "
                                  f"{len(state.models)}; resume with the same training code")
        for model, saved in zip(state.models[self.models_done:], model_states[self.models_done:], strict=False):
            state.strategy.load_model_state_dict(model, saved)
        self.models_done = len(state.models)
        optimizer_states = self.rank_state.get("optimizers", self.loaded.optimizers)
        n_opt = len(state.optimizers)
        if n_opt > len(optimizer_states):
            raise CheckpointError(f"checkpoint {self.path} holds {len(optimizer_states)} optimizer state(s) but this "
                                  f"code wrapped {n_opt}; resume with the same training code")
        for opt, saved in zip(state.optimizers[self.optimizers_done:], optimizer_states[self.optimizers_done:n_opt],
                              strict=False):
            opt.load_state_dict(saved)
        self.optimizers_done = n_opt
        scheduler_states = optimizer_states[n_opt:]
        for sched, saved in zip(state.schedulers[self.schedulers_done:], scheduler_states[self.schedulers_done:],
                                strict=False):
            sched.load_state_dict(saved)
        self.schedulers_done = min(len(state.schedulers), len(scheduler_states))
        if not self.rank_state_done and self.models_done == len(model_states):
            self._apply_rank_state(state)

    def _apply_rank_state(self, state: TrainingState) -> None:
        self.rank_state_done = True
        if state.precision is not None:
            state.precision.load_state_dict(self.loaded.trainer_state.get("precision", {}))
        if self.restored.same_layout:
            set_rng_state(self.rank_state["rng"], state.strategy.device)
            state.strategy.load_state_dict(self.rank_state.get("strategy", {}))
        elif state.rank == 0:
            state._log_layout_change(self.path, self.loaded.metadata.get("world_size"))
