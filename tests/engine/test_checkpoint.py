"""Checkpoints: resume equals an uninterrupted run, bit for bit; damaged checkpoints are refused."""

import json
import shutil
import time

import pytest
import torch
from helpers import cli_in_process, final_weights, tiny_config

from dtrain.engine import checkpoint

COMMON = {"hyperparameters.dropout": 0.1, "max_length": {"batches": 24},
          "min_checkpoint_period": {"batches": 10}, "min_validation_period": {"batches": 12}}



def _metrics(run_dir):
    """Every report's numbers (timings like samples/s naturally differ between runs)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["kind"], r["batches"], r["epoch"], r["metrics"]) for r in records]


def _assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run every interrupted one must reproduce, bit for bit."""
    tmp = tmp_path_factory.mktemp("straight")
    result = cli_in_process("run", str(tiny_config(tmp, **COMMON)), "--run-dir", str(tmp / "r"), "--quiet")
    assert result.code == 0, result.stderr
    return tmp / "r"


@pytest.mark.slow
def test_crash_then_resume_is_bit_identical(tmp_path, straight):
    crashed = tmp_path / "crashed"
    cfg = tiny_config(tmp_path, **COMMON, **{"hyperparameters.crash_at_batch": 13})
    start = time.monotonic()
    result = cli_in_process("run", str(cfg), "--run-dir", str(crashed), "--quiet")
    assert result.code == 1
    assert "worker rank 1 failed: RuntimeError: planted failure at batch 13" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - start < 60
    assert (crashed / "checkpoints" / "latest").read_text().strip() == "10"

    resumed = cli_in_process("run", str(cfg), "--resume", str(crashed), "--quiet",
                         "--set", "hyperparameters.crash_at_batch=null")
    assert resumed.code == 0, resumed.stderr
    _assert_bit_identical(final_weights(straight), final_weights(crashed))
    # Metrics after the resume point match too (the unreported sums were checkpointed).
    assert _metrics(crashed) == _metrics(straight)
    assert list(crashed.glob("config.before-resume-*.yaml"))


@pytest.mark.slow
def test_elastic_restart_resumes_from_latest_checkpoint(tmp_path, straight):
    marker = tmp_path / "crashed-once"
    cfg = tiny_config(tmp_path, **COMMON, max_restarts=1,
                      **{"hyperparameters.crash_at_batch": 15, "hyperparameters.crash_once_marker": str(marker)})
    result = cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "elastic"), "--quiet")
    assert result.code == 0, result.stderr
    assert marker.exists()  # it did crash, and the agent restarted it
    _assert_bit_identical(final_weights(straight), final_weights(tmp_path / "elastic"))


@pytest.mark.slow
def test_dead_worker_fails_the_job_promptly(tmp_path):
    cfg = tiny_config(tmp_path, **{"hyperparameters.die_at_batch": 5})
    start = time.monotonic()
    result = cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "dead"), "--quiet")
    assert result.code == 1
    assert "worker rank 1 failed" in result.stderr and "17" in result.stderr
    assert time.monotonic() - start < 45


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """A finished 1-slot run with one checkpoint (tests that damage it work on a copy)."""
    tmp = tmp_path_factory.mktemp("short")
    cfg = tiny_config(tmp, **{"max_length": {"batches": 8}})
    result = cli_in_process("run", str(cfg), "--run-dir", str(tmp / "r"), "--quiet", "--slots", "1")
    assert result.code == 0, result.stderr
    return cfg, tmp / "r"


@pytest.mark.slow
def test_tampered_and_truncated_checkpoints_are_refused(tmp_path, short_run):
    cfg, run_dir = short_run[0], tmp_path / "r"
    shutil.copytree(short_run[1], run_dir)
    ckpt = run_dir / "checkpoints" / "8"
    model = ckpt / "model.pt"
    original = model.read_bytes()
    model.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    result = cli_in_process("run", str(cfg), "--resume", str(run_dir))
    assert result.code == 2
    assert "does not match its recorded sha256" in result.stderr and "Traceback" not in result.stderr
    model.write_bytes(original[: len(original) // 2])
    result = cli_in_process("run", str(cfg), "--resume", str(run_dir))
    assert result.code == 2 and "truncated or tampered" in result.stderr
    assert model.read_bytes() == original[: len(original) // 2]  # nothing on disk was touched
    (ckpt / "metadata.json").write_text("{")
    result = cli_in_process("run", str(cfg), "--resume", str(run_dir))
    assert result.code == 2 and "no readable metadata.json" in result.stderr


@pytest.mark.slow
def test_checkpoint_contents(short_run):
    run_dir = short_run[1]
    ckpt = run_dir / "checkpoints" / "8"
    assert {p.name for p in ckpt.iterdir()} == {"model.pt", "optimizer.pt", "trainer_state.pt", "rank0.pt",
                                                "metadata.json"}
    weights = torch.load(ckpt / "model.pt", weights_only=True)
    assert set(weights) == {"0.weight", "0.bias", "3.weight", "3.bias"}  # the unwrapped model, no "module."
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta["batches"] == 8 and meta["world_size"] == 1
    assert not list(run_dir.joinpath("checkpoints").glob(".tmp-*"))


def test_resume_without_checkpoint(tmp_path):
    cfg = tiny_config(tmp_path)
    (tmp_path / "empty").mkdir()
    result = cli_in_process("run", str(cfg), "--resume", str(tmp_path / "empty"))
    assert result.code == 2 and "no checkpoint found" in result.stderr
    result = cli_in_process("run", str(cfg), "--resume", str(tmp_path / "missing"))
    assert result.code == 2 and "no such run directory" in result.stderr


def test_rng_state_holds_this_ranks_gpu_only(monkeypatch):
    """Saved: the generator of the rank's own device. Restored: into that device; an older checkpoint's
    list of every GPU's state restores the rank's entry, or nothing where the list is shorter (it used to
    raise IndexError where fewer GPUs were visible than when it was saved)."""
    asked, restored = [], []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: asked.append(device) or torch.tensor([7]))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((int(state[0]), device)))
    gpu1 = torch.device("cuda", 1)
    state = checkpoint.rng_state(gpu1)
    assert asked == [gpu1] and torch.equal(state["cuda"], torch.tensor([7]))
    assert "cuda" not in checkpoint.rng_state(torch.device("cpu"))
    checkpoint.set_rng_state(state, gpu1)
    checkpoint.set_rng_state({**state, "cuda": [torch.tensor([5]), torch.tensor([6])]}, gpu1)
    checkpoint.set_rng_state({**state, "cuda": [torch.tensor([5])]}, gpu1)  # saved where one GPU was visible
    assert restored == [(7, gpu1), (6, gpu1)]
