"""Checkpoints from untrusted hands: a crafted pickle in any file never runs; signing refuses forgeries.

The checkpoint is written in-process by the real ``DistributedContext.save_checkpoint`` (a world of one
needs no workers); ``dtrain run --resume`` is called in-process too: the launcher reads every file as
data before any worker starts, so a bad checkpoint stops there.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import tiny_config
from torch import nn

import dtrain
from dtrain import cli
from dtrain.engine import checkpoint
from dtrain.errors import CheckpointError

FILES = ["model.pt", "optimizer.pt", "trainer_state.pt", "rank0.pt"]


class _Payload:
    """Unpickling this runs a shell command (what an attacker would plant)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


def _write_checkpoint(run_dir: Path) -> Path:
    ctx = dtrain.init(seed=0)
    try:
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 1))
        model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        ctx.backward(model(torch.randn(4, 8)).pow(2).mean())
        ctx.step_optimizer(opt)  # momentum buffers: the optimizer state holds tensors
        return ctx.save_checkpoint(run_dir / "checkpoints", 8, extra={"batches": 8},
                                   rank_extra={"train_metrics": {"sums": {"loss": 1.5}, "weight": 2.0}})
    finally:
        ctx.close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config, run directory holding one honest, unsigned checkpoint)."""
    tmp = tmp_path_factory.mktemp("untrusted")
    cfg = tiny_config(tmp, **{"resources.slots_per_trial": 1})
    run_dir = tmp / "run"
    ckpt = _write_checkpoint(run_dir)
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([*FILES, "metadata.json"])
    return cfg, run_dir


def _copy(pristine: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path, Path]:
    cfg, run_dir = pristine
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return cfg, target, target / "checkpoints" / "8"


def _plant(ckpt: Path, name: str, marker: Path, legacy: bool = False) -> None:
    """Replace one file by a malicious pickle and fix its sha256 in the manifest, as an attacker would."""
    file = ckpt / name
    if legacy:  # torch.load also reads plain (pre-zip) pickles: refuse those too
        file.write_bytes(pickle.dumps({"state": _Payload(marker)}, protocol=2))
    else:
        torch.save({"state": _Payload(marker)}, file)
    meta = json.loads((ckpt / "metadata.json").read_text())
    meta["files"][name] = hashlib.sha256(file.read_bytes()).hexdigest()
    (ckpt / "metadata.json").write_text(json.dumps(meta))


def _resume(cfg: Path, run_dir: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["run", str(cfg), "--resume", str(run_dir), "--quiet"])
    return code, err.getvalue()


def test_the_payload_is_live(tmp_path: Path) -> None:
    """The planted file really runs code when loaded the old way: the tests below test something."""
    marker = tmp_path / "pwned"
    torch.save({"state": _Payload(marker)}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


def test_honest_checkpoint_loads_as_data(pristine: tuple[Path, Path]) -> None:
    _, run_dir = pristine
    loaded = checkpoint.load(run_dir / "checkpoints" / "8", rank=0)
    assert loaded.trainer_state["extra"]["batches"] == 8
    assert set(loaded.rank_state["rng"]) >= {"torch", "numpy", "python"}
    assert isinstance(loaded.rank_state["rng"]["numpy"]["keys"], torch.Tensor)
    checkpoint.set_rng_state(loaded.rank_state["rng"])  # round trip through the tensor form


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-pickle"])
def test_crafted_pickle_never_runs(pristine: tuple[Path, Path], tmp_path: Path, name: str, legacy: bool) -> None:
    cfg, run_dir, ckpt = _copy(pristine, tmp_path)
    marker = tmp_path / "pwned"
    _plant(ckpt, name, marker, legacy)
    code, err = _resume(cfg, run_dir)  # the launcher, before any worker
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("dtrain: error: ") and "Traceback" not in err, err
    reason = "not a torch zip archive" if legacy else "Trying to load unsupported GLOBAL posix.system"
    assert f"{name} is not plain data ({reason}" in err, err
    with pytest.raises(CheckpointError, match="is not plain data"):  # each worker's own load
        checkpoint.load(ckpt, rank=0)
    assert not marker.exists()
    assert not (run_dir / "logs" / "rank0.log").exists()  # no worker started


def test_manifest_cannot_point_outside_or_hide_a_file(pristine: tuple[Path, Path], tmp_path: Path) -> None:
    _, _, ckpt = _copy(pristine, tmp_path)
    meta_path = ckpt / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "files": {**meta["files"], "../../../../dev/zero": "0"}}))
    with pytest.raises(CheckpointError, match="not a file of this checkpoint"):
        checkpoint.verify(ckpt)
    files = {k: v for k, v in meta["files"].items() if k != "rank0.pt"}  # an unlisted file is never read
    meta_path.write_text(json.dumps({**meta, "files": files}))
    (ckpt / "rank0.pt").write_bytes(b"not even a pickle")
    assert checkpoint.load(ckpt, rank=0).rank_state is None


def test_signed_checkpoints(pristine: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, run_dir, _ = _copy(pristine, tmp_path)
    monkeypatch.setenv(checkpoint.KEY_ENV, "s3cret")
    code, err = _resume(cfg, run_dir)
    assert code == 2 and "is not signed but DTRAIN_CHECKPOINT_KEY is set" in err and err.count("\n") == 1, err

    signed = _write_checkpoint(tmp_path / "signed")  # written with the key: carries an HMAC
    meta = json.loads((signed / "metadata.json").read_text())
    assert len(meta["hmac"]) == 64
    checkpoint.check(signed)
    assert checkpoint.load(signed, rank=0).trainer_state["extra"]["batches"] == 8

    torch.save({"extra": {"batches": 9999}}, signed / "trainer_state.pt")  # data only, manifest fixed up
    meta["files"]["trainer_state.pt"] = hashlib.sha256((signed / "trainer_state.pt").read_bytes()).hexdigest()
    (signed / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="invalid signature"):
        checkpoint.load(signed, rank=0)

    honest = _write_checkpoint(tmp_path / "other")
    monkeypatch.setenv(checkpoint.KEY_ENV, "another key")
    with pytest.raises(CheckpointError, match="invalid signature"):
        checkpoint.verify(honest)
    monkeypatch.delenv(checkpoint.KEY_ENV)
    checkpoint.check(honest)  # without a key a signed checkpoint is still data-only and loads


def test_state_that_is_not_data_is_refused_at_save(tmp_path: Path) -> None:
    ctx = dtrain.init(seed=0)
    try:
        ctx.wrap_model(nn.Linear(2, 1))
        with pytest.raises(CheckpointError, match="would not load back as data"):
            ctx.save_checkpoint(tmp_path / "c", 1, extra={"when": object()})
    finally:
        ctx.close()
