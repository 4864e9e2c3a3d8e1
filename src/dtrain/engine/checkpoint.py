"""Crash-proof checkpoints.

Layout of ``<storage>/<batches>/``::

    model.pt           plain state_dict of the (first) unwrapped model: torch.load(..., weights_only=True)
    model_<i>.pt       further models, if the trial wrapped several
    optimizer.pt       list of optimizer (and LR scheduler) state dicts
    trainer_state.pt   batches trained, epoch, strategy state
    rank<r>.pt         each rank's RNG states and unreported metric sums
    metadata.json      versions, world size, sha256 of every file above (and an HMAC of it all, if signed)

A checkpoint is built in a hidden temporary folder, every file fsynced, then renamed into place in one
step; ``latest`` (also written by rename) names the newest. A crash at any moment leaves either the old
or the new checkpoint, never half of one; the sha256 list catches truncation and accidents on load.

Checkpoints hold data, never code: every ``.pt`` file holds only tensors and plain Python values (RNG
states are converted to tensors), is read back that way before it is committed, and is loaded with
``torch.load(..., weights_only=True)``, whose unpickler refuses any global it does not know. So a
tampered file cannot run code; it is refused with one line. The sha256 list sits beside the files, so
it proves nothing against someone who can write them: for that, set ``DTRAIN_CHECKPOINT_KEY`` and every
``metadata.json`` carries an HMAC-SHA256 over its content (file digests included), without which a
checkpoint is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import importlib
import json
import logging
import os
import random
import re
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtrain.dist import barrier
from dtrain.errors import CheckpointError

log = logging.getLogger(__name__)
# 2: RNG states stored as tensors (format 1 kept numpy arrays, which only a code-running load reads).
FORMAT_VERSION = 2
LATEST = "latest"
KEY_ENV = "DTRAIN_CHECKPOINT_KEY"
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_MAX_METADATA_BYTES = 16 << 20


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
    torch.save(_on_cpu(obj), path)
    _fsync_file(path)


def _on_cpu(obj: Any) -> Any:
    """``obj`` with every tensor on the CPU: a file holding ``cuda:N`` tensors does not load (as docs/config.md's
    ``checkpoints/<batches>/model.pt`` does) on a machine without that GPU. Loading puts them back: ``load_state_dict``
    copies into the model's parameters, and optimizers cast their state to each parameter's device."""
    if isinstance(obj, torch.Tensor):
        # A DTensor (FSDP's per-rank optimizer state) keeps its device: its mesh names it, and it loads
        # back only where that mesh exists anyway.
        return obj.cpu() if obj.device.type != "cpu" and not hasattr(obj, "device_mesh") else obj
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's torch, numpy and Python RNG states, as tensors and plain values (weights_only-loadable),
    and the CUDA generator of this rank's ``device`` only: every visible GPU's would not restore where
    fewer are visible, and the other GPUs' generators belong to other ranks."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what :func:`rng_state` returned (the CUDA generator into ``device``'s); a malformed state is
    a :class:`CheckpointError`."""
    try:
        np_state, py_state = state["numpy"], state["python"]
        keys = np_state["keys"].numpy().astype(np.uint32)
        internal = tuple(int(v) for v in py_state["state"].tolist())
        torch.set_rng_state(state["torch"])
        np.random.set_state((np_state["kind"], keys, int(np_state["pos"]), int(np_state["has_gauss"]),
                             float(np_state["cached_gaussian"])))
        random.setstate((int(py_state["version"]), internal, py_state["gauss_next"]))
        cuda = state.get("cuda")
        if isinstance(cuda, list):  # older checkpoints: every GPU the rank saw, indexed by device
            cuda = cuda[device.index or 0] if device is not None and (device.index or 0) < len(cuda) else None
        if cuda is not None and device is not None and device.type == "cuda":
            torch.cuda.set_rng_state(cuda, device)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, IndexError) as exc:
        raise CheckpointError(f"the RNG state in this checkpoint is malformed ({_first_line(exc)}); resume from "
                              "an older checkpoint or start a new run") from None


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
    for p in sorted(tmp.glob("*.pt")):  # every rank's file is here by now: refuse to commit what cannot load
        _load_data(p, mmap=True, when="saving")
    files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
    meta = {
        "format_version": FORMAT_VERSION,
        "batches": payload.batches,
        "torch_version": torch.__version__,
        "time": time.time(),
        "files": files,
        **payload.metadata,
    }
    key = signing_key()
    if key is not None:
        meta["hmac"] = _signature(meta, key)
    (tmp / "metadata.json").write_text(json.dumps(meta, indent=2))
    _fsync_file(tmp / "metadata.json")
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again after a resume: the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _point_latest(root, final.name)


def _point_latest(root: Path, name: str | None) -> None:
    """``latest`` names ``name`` (written by rename), or is removed (None)."""
    if name is None:
        (root / LATEST).unlink(missing_ok=True)
    else:
        latest_tmp = root / f".{LATEST}.tmp"
        latest_tmp.write_text(name + "\n")
        _fsync_file(latest_tmp)
        os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)


def withdraw(root: Path, batches: int, only_if_extra: str) -> bool:
    """Take back the checkpoint at ``batches`` if its ``extra`` holds the key ``only_if_extra`` (a survivor
    save the survivors turned out to disagree on): it is renamed away in one step and ``latest`` names the
    newest one left (or goes). Whether it was taken back."""
    path = root / str(batches)
    try:
        if only_if_extra not in read_extra(path):
            return False
    except CheckpointError:
        return False
    doomed = root / f".deleting-{path.name}"
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    done = [p for p in root.iterdir() if p.is_dir() and p.name.isdigit() and (p / "metadata.json").is_file()]
    _point_latest(root, max(done, key=lambda p: int(p.name)).name if done else None)
    shutil.rmtree(doomed, ignore_errors=True)
    return True


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


def newest_complete(root: Path) -> Path | None:
    """The checkpoint ``latest`` names, else the highest-numbered folder with its metadata.json (the last
    file a commit writes), else None: no folder, nothing saved yet, or only unfinished temporaries."""
    if not root.is_dir():
        return None
    named = latest(root)
    if named is not None and (named / "metadata.json").is_file():
        return named
    done = [p for p in root.iterdir() if p.is_dir() and p.name.isdigit() and (p / "metadata.json").is_file()]
    return max(done, key=lambda p: int(p.name)) if done else None


@dataclass
class LoadedCheckpoint:
    path: Path
    metadata: dict[str, Any]
    models: list[dict[str, Any]]
    optimizers: list[dict[str, Any]]
    trainer_state: dict[str, Any]
    rank_state: dict[str, Any] | None


def verify(path: Path) -> dict[str, Any]:
    """Read metadata.json, check its signature (if a key is set) and every file's sha256; raise
    :class:`CheckpointError` with the fix."""
    meta_path = path / "metadata.json"
    try:
        if meta_path.stat().st_size > _MAX_METADATA_BYTES:
            raise ValueError("too big")
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
        if not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
            raise TypeError("files is not a mapping of names to digests")
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"checkpoint {path} has no readable metadata.json: it is incomplete or was edited; "
            "resume from an older checkpoint or start a new run"
        ) from None
    _check_signature(path, meta)
    for name, expected in files.items():
        if not isinstance(name, str) or not _FILE_NAME.match(name):
            raise CheckpointError(f"checkpoint {path}: metadata.json lists {name!r:.80}, not a file of this "
                                  "checkpoint (tampered); resume from an older checkpoint")
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}; resume from an older checkpoint")
        if _sha256(file) != expected:
            raise CheckpointError(
                f"checkpoint file {file} does not match its recorded sha256 (truncated or tampered); "
                "resume from an older checkpoint or start a new run"
            )
    return meta


def check(path: Path) -> dict[str, Any]:
    """What the launcher runs before any worker starts: :func:`verify`, then read every file as data
    (memory-mapped, so tensors are not read), so a bad checkpoint costs one line, not N worker failures."""
    meta = verify(path)
    _check_format(path, meta)
    for name in meta["files"]:
        if name.endswith(".pt"):
            _load_data(path / name, mmap=True)
    return meta


def read_extra(path: Path) -> dict[str, Any]:
    """The ``extra`` mapping of a checkpoint that :func:`check` passed (empty where it has none): what the
    launcher needs of the run's progress before any worker starts."""
    if "trainer_state.pt" not in verify(path)["files"]:
        return {}
    state = _load_data(path / "trainer_state.pt")
    extra = state.get("extra") if isinstance(state, dict) else None
    return extra if isinstance(extra, dict) else {}


def load(path: Path, rank: int) -> LoadedCheckpoint:
    """Verify and load a checkpoint (data only) for ``rank``; raise :class:`CheckpointError` if it is bad."""
    meta = verify(path)
    _check_format(path, meta)
    files = meta["files"]
    if "model.pt" not in files:
        raise CheckpointError(f"checkpoint {path}: metadata.json does not list model.pt; resume from an older "
                              "checkpoint")
    # Only files the manifest lists (and so the signature covers) are read.
    models = [_load_data(path / "model.pt")]
    i = 1
    while f"model_{i}.pt" in files:
        models.append(_load_data(path / f"model_{i}.pt"))
        i += 1
    optimizers = _load_data(path / "optimizer.pt") if "optimizer.pt" in files else None
    trainer_state = _load_data(path / "trainer_state.pt") if "trainer_state.pt" in files else None
    rank_file = f"rank{rank}.pt"
    rank_state = _load_data(path / rank_file) if rank_file in files else None
    shapes_ok = (all(isinstance(m, dict) for m in models) and isinstance(optimizers, list)
                 and isinstance(trainer_state, dict) and isinstance(trainer_state.get("extra", {}), dict)
                 and (rank_state is None or (isinstance(rank_state, dict) and isinstance(rank_state.get("rng"), dict))))
    if not shapes_ok:
        raise CheckpointError(f"checkpoint {path} does not hold what dtrain writes (models, optimizer list, trainer "
                              "and rank state); resume from an older checkpoint or start a new run")
    return LoadedCheckpoint(path, meta, models, optimizers, trainer_state, rank_state)  # type: ignore[arg-type]


def _check_format(path: Path, meta: dict[str, Any]) -> None:
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version!r:.20}, this dtrain reads "
                              f"{FORMAT_VERSION} (version 1 stored RNG states that only a code-running load can "
                              "read); start a new run or resume with the dtrain that wrote it")


def _load_data(file: Path, mmap: bool = False, when: str = "loading") -> Any:
    """``torch.load`` that accepts tensors and plain values only; anything else is a one-line error."""
    # FSDP's per-rank optimizer state holds DTensors: torch itself allow-lists them for weights_only loads
    # once its DTensor module is imported (a launcher has not); unpickling their DeviceMesh outside a job
    # logs a warning that concerns only torch.compile.
    with contextlib.suppress(ImportError):
        importlib.import_module("torch.distributed.tensor")
    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)
    try:
        if not zipfile.is_zipfile(file):  # dtrain writes only torch's zip format; never parse anything else
            raise ValueError("not a torch zip archive, the only format dtrain writes")
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # untrusted bytes: whatever torch raises (zip, pickle, storage errors) means "bad"
        if when == "saving":
            raise CheckpointError(f"checkpoint file {file.name} would not load back as data ({_first_line(exc)}): "
                                  "keep only tensors, numbers, strings, lists and dicts in checkpointed state "
                                  "(e.g. the trial's extra)") from None
        raise CheckpointError(f"checkpoint file {file} is not plain data ({_first_line(exc)}); it was tampered "
                              "with or is damaged: resume from an older checkpoint or start a new run") from None
    finally:
        mesh_log.setLevel(level)


def _first_line(exc: BaseException) -> str:
    """The informative line of an exception, for a one-line message: torch's unpickler names the refused
    global in the middle of a long text."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    telling = [ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln or "WeightsUnpickler" in ln]
    line = (telling or lines or [type(exc).__name__])[0].removeprefix("WeightsUnpickler error: ")
    line = line.split(". ", 1)[0].rstrip(".")
    return repr(line)[1:-1][:160]


def signing_key() -> bytes | None:
    """The HMAC key from ``DTRAIN_CHECKPOINT_KEY``, or None (unsigned checkpoints). Only the environment:
    a key in the config would be written into the run directory, beside the checkpoints it protects."""
    key = os.environ.get(KEY_ENV, "")
    return key.encode() if key else None


def _signature(meta: dict[str, Any], key: bytes) -> str:
    body = {k: v for k, v in meta.items() if k != "hmac"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def _check_signature(path: Path, meta: dict[str, Any]) -> None:
    key = signing_key()
    if key is None:
        return  # unsigned mode; a signed checkpoint still loads (data only) without the key
    signature = meta.get("hmac")
    if not isinstance(signature, str):
        raise CheckpointError(f"checkpoint {path} is not signed but {KEY_ENV} is set: refusing it; resume from a "
                              f"checkpoint written with the key, or unset {KEY_ENV} if you trust this one")
    if not hmac.compare_digest(signature, _signature(meta, key)):
        raise CheckpointError(f"checkpoint {path} has an invalid signature for the {KEY_ENV} set here (tampered, or "
                              "written with another key); resume from a checkpoint signed with this key")


# ------------------------------------------------------------------------------ one rank's training state


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
