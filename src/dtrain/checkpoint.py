"""Crash-proof checkpoints.

Layout of ``<storage>/<batches>/``::

    model.pt           plain state_dict of the (first) unwrapped model: torch.load(..., weights_only=True)
    model_<i>.pt       further models, if the trial wrapped several
    optimizer.pt       list of optimizer (and LR scheduler) state dicts
    trainer_state.pt   batches trained, epoch, strategy state
    rank<r>.pt         each rank's RNG states and unreported metric sums
    metadata.json      versions, world size, sha256 of every file above

A checkpoint is built in a hidden temporary folder, every file fsynced, then renamed into place in one
step; ``latest`` (also written by rename) names the newest. A crash at any moment leaves either the old
or the new checkpoint, never half of one; the sha256 list catches truncation and tampering on load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtrain.dist import barrier
from dtrain.errors import CheckpointError

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
LATEST = "latest"


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _save(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    _fsync_file(path)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class CheckpointPayload:
    """What the trainer hands over for one checkpoint (all on CPU-loadable tensors)."""

    batches: int
    models: list[dict[str, Any]]
    optimizers: list[dict[str, Any]]
    trainer_state: dict[str, Any]
    metadata: dict[str, Any]


def save(root: Path, payload: CheckpointPayload | None, rank_state: dict[str, Any], rank: int, keep_last: int) -> Path:
    """Collective: every rank calls it; rank 0 passes the payload, the others ``None``."""
    final = root / str(_batches_of(payload, rank_state))
    tmp = root / f".tmp-{final.name}"
    if payload is not None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    _save(rank_state, tmp / f"rank{rank}.pt")
    barrier()
    if payload is not None:
        _commit(root, tmp, final, payload)
        _prune(root, keep_last)
    barrier()
    return final


def _batches_of(payload: CheckpointPayload | None, rank_state: dict[str, Any]) -> int:
    return payload.batches if payload is not None else int(rank_state["batches"])


def _commit(root: Path, tmp: Path, final: Path, payload: CheckpointPayload) -> None:
    for i, state in enumerate(payload.models):
        _save(state, tmp / ("model.pt" if i == 0 else f"model_{i}.pt"))
    _save(payload.optimizers, tmp / "optimizer.pt")
    _save(payload.trainer_state, tmp / "trainer_state.pt")
    files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
    meta = {
        "format_version": FORMAT_VERSION,
        "batches": payload.batches,
        "torch_version": torch.__version__,
        "time": time.time(),
        "files": files,
        **payload.metadata,
    }
    (tmp / "metadata.json").write_text(json.dumps(meta, indent=2))
    _fsync_file(tmp / "metadata.json")
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again after a resume: the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / f".{LATEST}.tmp"
    latest_tmp.write_text(final.name + "\n")
    _fsync_file(latest_tmp)
    os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)


def _prune(root: Path, keep_last: int) -> None:
    """Delete all but the ``keep_last`` newest checkpoints, and never the newest one with finite weights.

    Each is first renamed to ``.deleting-N`` (one atomic step), then deleted: a crash midway leaves a
    hidden folder, never a numbered one with files missing. Leftovers of earlier crashes (``.deleting-*``,
    other saves' ``.tmp-*``) are removed here too.
    """
    done = sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    keep = set(done[-keep_last:])
    if not any(_finite(p) for p in keep):
        keep |= set(_newest_finite(done))
    for old in done:
        if old in keep:
            continue
        doomed = root / f".deleting-{old.name}"
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    for leftover in [*root.glob(".deleting-*"), *root.glob(".tmp-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def _finite(path: Path) -> bool:
    """Whether a checkpoint's weights were all finite when saved (older checkpoints: assumed so)."""
    try:
        return bool(json.loads((path / "metadata.json").read_text()).get("finite", True))
    except (OSError, ValueError):
        return False


def _newest_finite(done: list[Path]) -> list[Path]:
    finite = [p for p in done if _finite(p)]
    return finite[-1:]


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if path.is_dir() else None


@dataclass
class LoadedCheckpoint:
    path: Path
    metadata: dict[str, Any]
    models: list[dict[str, Any]]
    optimizers: list[dict[str, Any]]
    trainer_state: dict[str, Any]
    rank_state: dict[str, Any] | None


def verify(path: Path) -> dict[str, Any]:
    """Read metadata.json and check every file's sha256; raise CheckpointError with the fix."""
    meta_path = path / "metadata.json"
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"checkpoint {path} has no readable metadata.json: it is incomplete or was edited; "
            "resume from an older checkpoint or start a new run"
        ) from None
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}; resume from an older checkpoint")
        if _sha256(file) != expected:
            raise CheckpointError(
                f"checkpoint file {file} does not match its recorded sha256 (truncated or tampered); "
                "resume from an older checkpoint or start a new run"
            )
    return meta


def load(path: Path, rank: int) -> LoadedCheckpoint:
    meta = verify(path)
    models = [torch.load(path / "model.pt", map_location="cpu", weights_only=True)]
    i = 1
    while (path / f"model_{i}.pt").is_file():
        models.append(torch.load(path / f"model_{i}.pt", map_location="cpu", weights_only=True))
        i += 1
    # Optimizer and RNG states hold numpy/python objects that weights_only refuses; the sha256 check above
    # guarantees these are the files dtrain wrote.
    optimizers = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    trainer_state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    rank_file = path / f"rank{rank}.pt"
    rank_state = torch.load(rank_file, map_location="cpu", weights_only=False) if rank_file.is_file() else None
    return LoadedCheckpoint(path, meta, models, optimizers, trainer_state, rank_state)


# ------------------------------------------------------------------------------ one rank's training state


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

    strategy: Any
    models: list[Any]
    optimizers: list[Any]
    schedulers: list[Any]
    precision: Any
    rank: int
    world_size: int

    def _optimizer_states(self) -> list[dict[str, Any]]:
        return [o.state_dict() for o in self.optimizers] + [s.state_dict() for s in self.schedulers]

    def save(self, directory: Path, batches: int, extra: dict[str, Any] | None = None, keep_last: int = 2,
             rank_extra: dict[str, Any] | None = None) -> Path:
        """Collective: every rank calls it."""
        models = [self.strategy.model_state_dict(m) for m in self.models]  # may be collective (FSDP)
        payload = None
        if self.rank == 0:
            trainer_state = {"extra": dict(extra or {})}
            if self.precision is not None and self.precision.state_dict():
                trainer_state["precision"] = self.precision.state_dict()
            payload = CheckpointPayload(batches=batches, models=models, optimizers=self._optimizer_states(),
                                        trainer_state=trainer_state,
                                        metadata={"world_size": self.world_size, "strategy": self.strategy.name,
                                                  "finite": _all_finite(models)})
        rank_state: dict[str, Any] = {"batches": batches, "rng": rng_state(), "extra": dict(rank_extra or {}),
                                      "strategy": self.strategy.state_dict()}
        if self.strategy.replicas_may_differ:
            rank_state["models"] = [self.strategy.unwrap(m).state_dict() for m in self.models]
        if self.strategy.per_rank_optimizer_state:
            rank_state["optimizers"] = self._optimizer_states()
        return save(directory, payload, rank_state, self.rank, keep_last)

    def restore(self, path: Path) -> Restored:
        """Load the checkpoint at ``path`` (a checkpoint folder, or a folder holding ``latest``) into the
        live objects."""
        path = resolve(path)
        loaded = load(path, self.rank)
        self._check_counts(loaded, path)
        saved_world = loaded.metadata.get("world_size")
        same_layout = (loaded.rank_state is not None and saved_world == self.world_size
                       and loaded.metadata.get("strategy", self.strategy.name) == self.strategy.name)
        rank_state = loaded.rank_state if same_layout and loaded.rank_state is not None else {}
        if self.strategy.per_rank_optimizer_state and "optimizers" not in rank_state:
            raise CheckpointError(f"checkpoint {path} has no optimizer state for rank {self.rank} of "
                                  f"{self.world_size} ({self.strategy.name} keeps it per rank); resume with "
                                  f"{saved_world} slots and the same sync.strategy")
        for model, state in zip(self.models, rank_state.get("models", loaded.models), strict=True):
            self.strategy.load_model_state_dict(model, state)
        optimizer_states = rank_state.get("optimizers", loaded.optimizers)
        n_opt = len(self.optimizers)
        for opt, state in zip(self.optimizers, optimizer_states[:n_opt], strict=True):
            opt.load_state_dict(state)
        for sched, state in zip(self.schedulers, optimizer_states[n_opt:], strict=False):
            sched.load_state_dict(state)
        if self.precision is not None:
            self.precision.load_state_dict(loaded.trainer_state.get("precision", {}))
        if same_layout:
            set_rng_state(rank_state["rng"])
            self.strategy.load_state_dict(rank_state.get("strategy", {}))
        elif self.rank == 0:
            self._log_layout_change(path, saved_world)
        extra = dict(loaded.trainer_state.get("extra", {}))
        rank_extra = dict(rank_state.get("extra", {})) if same_layout else None
        return Restored(path, extra, rank_extra, same_layout)

    def _log_layout_change(self, path: Path, saved_world: Any) -> None:
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


def _all_finite(states: list[dict[str, Any]]) -> bool:
    """Whether every floating-point tensor of these state dicts is finite (checkpoint rotation keeps the
    newest checkpoint for which this holds)."""
    return all(bool(torch.isfinite(t).all()) for state in states for t in state.values()
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def resolve(path: Path) -> Path:
    """A checkpoint folder, given it or a folder holding ``latest``; CheckpointError otherwise."""
    if (path / LATEST).is_file():
        found = latest(path)
        if found is None:
            raise CheckpointError(f"{path}/latest names a checkpoint that does not exist; point at a checkpoint folder")
        path = found
    if not (path / "metadata.json").exists():
        raise CheckpointError(f"{path} is not a dtrain checkpoint (no metadata.json); pass a checkpoint folder")
    return path
