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
    done = sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


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
