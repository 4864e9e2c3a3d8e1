"""Unmodified scripts profiled in real 2-rank jobs (issue 72, parts 1, 2 and 6): a plain DDP script trains under
``dtrain launch`` to the weights torchrun gives it; Lightning Fabric (launching itself, reached through
``DTRAIN_PROFILE``), the Lightning Trainer (``dtrain launch``) and Accelerate (``torchrun -m dtrain.profile``)
are each profiled once, and so is a script that starts its processes with ``mp.spawn`` (``DTRAIN_PROFILE``);
the doctor ranks the factors of each; a crash leaves a partial profile and the culprit's line; an FSDP script
(no DDP model) says what could not be seen."""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, cli_in_process, python_command, run_ranks

from dtrain.explain.doctor import diagnose
from dtrain.explain.predictor import Predictor
from dtrain.profiling.record import ProfileRecord, load_run_profile
from dtrain.profiling.runsummary import load_summary
from dtrain.profiling.script.merge import NO_DDP

SCRIPTS = ROOT / "examples" / "scripts"
PLAIN = SCRIPTS / "ddp_plain.py"
# The plain script's model: Linear(32, 256), Linear(256, 256), Linear(256, 10), fp32 gradients.
PLAIN_GRADIENT_BYTES = 4 * (32 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10)

pytestmark = pytest.mark.slow


def _torchrun(*args: str) -> list[str]:
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


def _profiled(run_dir: Path, steps: int, launcher: str) -> ProfileRecord:
    """The run's profile, as the doctor reads it, holding both ranks' figures and ``steps`` steps; the doctor
    ranks its factors."""
    record = load_run_profile(run_dir)
    assert record.script is not None and record.script.launcher == launcher
    assert record.script.ranks_reported == [0, 1] and record.script.complete
    assert record.slots == 2 and record.steps == steps and not record.probes
    assert [r.rank for r in record.per_rank] == [0, 1]
    assert record.stragglers is not None
    assert load_summary(run_dir / "summary.json").steps == steps
    diagnosis = diagnose(record, Predictor(record))
    assert diagnosis.phases_observed and diagnosis.top_factor is not None
    # The factors add up to the step, but for the straggler's remainder, which is never negative.
    assert sum(f.seconds_per_step for f in diagnosis.factors) == pytest.approx(diagnosis.step_seconds, rel=0.1)
    assert [f.share for f in diagnosis.factors] == sorted((f.share for f in diagnosis.factors), reverse=True)
    return record


def _script_as_a_rank(rank: int, world: int, argv: list[str], done: Path) -> None:
    """The script run as ``__main__`` in a rank that torchrun's environment variables describe (``run_ranks``).
    Rank 0 serves the ranks' store here (torchrun's agent does there), so it stays until every rank is done."""
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    (done / f"rank{rank}").touch()
    deadline = time.monotonic() + 60
    while rank == 0 and len(list(done.iterdir())) < world and time.monotonic() < deadline:
        time.sleep(0.01)


def test_plain_ddp_trains_as_under_torchrun_and_is_profiled(tmp_path: Path) -> None:
    steps = 8
    # A planted straggler: rank 1 sleeps before each forward (the weights do not change).
    args = [str(PLAIN), "--steps", str(steps), "--validate-every", "3", "--late-rank", "1", "--late-seconds", "0.08"]
    # The script without dtrain, in 2 ranks that torchrun's variables describe (RANK, WORLD_SIZE, MASTER_ADDR...):
    # forked from this process, not started by torchrun (Accelerate's test below is), which would import torch
    # again in each. --keep-group: with its group destroyed, a rank forked here hung now and then as main()
    # returned and its DDP model was freed (in C++; 1 run in 4); the weights are saved before that.
    (tmp_path / "done").mkdir()
    run_ranks(_script_as_a_rank, 2, timeout=120,
              args=([*args, "--save", str(tmp_path / "torchrun.pt"), "--keep-group"], tmp_path / "done"))
    run_dir = tmp_path / "run"
    launched = cli_in_process("launch", "--slots", "2", "--run-dir", str(run_dir), *args,
                              "--save", str(tmp_path / "launch.pt"))
    assert launched.code == 0, launched.stderr
    reference = torch.load(tmp_path / "torchrun.pt", weights_only=True)
    trained = torch.load(tmp_path / "launch.pt", weights_only=True)
    assert reference.keys() == trained.keys()
    assert all(torch.equal(reference[k], trained[k]) for k in reference)  # profiling changed nothing

    record = _profiled(run_dir, steps, "dtrain launch")
    script = record.script
    assert script is not None
    assert script.command == [str(PLAIN), *args[1:], "--save", str(tmp_path / "launch.pt")]
    assert script.cwd == str(ROOT) and len(script.script_sha256) == 64
    assert [m.bucket_cap_mb for m in script.models] == [None] and script.models[0].comm_hook is None
    assert script.loader is not None and script.loader.batch_size == 32 and script.loader.num_workers == 0
    assert script.micro_batches_per_step == 1 and script.exchanges_per_step == 1 and not script.no_sync
    # DDP's own bucket sizes: every gradient byte once per step.
    assert record.comm.bytes_per_step == PLAIN_GRADIENT_BYTES and record.comm.busy_seconds_per_step > 0
    assert record.comm.latency_seconds > 0  # probed at the script's destroy_process_group(), every rank there
    assert record.gradient_bytes is not None and sum(record.gradient_bytes[0]) == PLAIN_GRADIENT_BYTES
    assert record.validation_seconds > 0  # the validation passes, left out of the steps
    # The straggler named, as for a Trial: rank 1, slow in its forward, a large share of the step.
    assert record.stragglers is not None and record.stragglers.chronic_rank == 1
    assert record.stragglers.per_rank[1].slow_phase == "forward"
    diagnosis = diagnose(record)
    straggler = diagnosis.factor("straggler")
    assert straggler is not None and straggler.share > 0.2 and "rank 1" in straggler.why
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_accelerate_under_torchrun_module(tmp_path: Path) -> None:
    run_dir = tmp_path / "accel"
    result = python_command(*_torchrun("-m", "dtrain.profile", "--run-dir", str(run_dir),
                                       str(SCRIPTS / "accelerate_synthetic.py"), "--steps", "8"), timeout=120)
    assert result.code == 0, result.stderr
    record = _profiled(run_dir, 8, "python -m dtrain.profile")
    assert record.optimizer == "AdamW" and record.comm.bytes_per_step == 4 * (32 * 128 + 128 + 128 * 10 + 10)
    assert record.per_slot_batch_size == 32 and record.global_batch_size == 64  # Accelerate's sharded sampler


def test_lightning_trainer_under_dtrain_launch(tmp_path: Path) -> None:
    run_dir = tmp_path / "trainer"
    result = cli_in_process("launch", "--slots", "2", "--run-dir", str(run_dir),
                            str(SCRIPTS / "trainer_synthetic.py"), "--steps", "8")
    assert result.code == 0, result.stderr
    record = _profiled(run_dir, 8, "dtrain launch")
    # Forward and backward ran inside optimizer.step(closure); the validation pass at step 6 is no step.
    assert record.seconds_per_step.forward.mean > 0 and record.seconds_per_step.backward.mean > 0
    assert record.validation_seconds > 0


def test_fabric_launching_itself_is_reached_through_the_environment(tmp_path: Path) -> None:
    run_dir = tmp_path / "fabric"
    env = {**os.environ, "DTRAIN_PROFILE": str(run_dir)}
    result = _python_with_env(env, str(SCRIPTS / "fabric_synthetic.py"), "--steps", "8")
    assert result.code == 0, result.stderr
    record = _profiled(run_dir, 8, "DTRAIN_PROFILE")
    assert record.optimizer == "Adam"


def test_mp_spawn_children_are_reached_through_the_environment(tmp_path: Path) -> None:
    run_dir = tmp_path / "spawn"
    env = {**os.environ, "DTRAIN_PROFILE": str(run_dir)}
    result = _python_with_env(env, str(SCRIPTS / "spawn_ddp.py"), "--steps", "8")
    assert result.code == 0, result.stderr
    # mp.spawn's children leave by os._exit: their figures are taken by multiprocessing's finalizers.
    record = _profiled(run_dir, 8, "DTRAIN_PROFILE")
    assert record.comm.bytes_per_step == 4 * (16 * 64 + 64 + 64 + 1)


def _python_with_env(env: dict[str, str], *args: str) -> object:
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        return python_command(*args, timeout=120)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_a_crash_names_the_rank_and_line_and_leaves_a_partial_profile(tmp_path: Path) -> None:
    run_dir = tmp_path / "crash"
    result = cli_in_process("launch", "--slots", "2", "--run-dir", str(run_dir), str(PLAIN), "--steps", "20",
                            "--crash-at", "6")
    assert result.code == 1
    line = next(text for text in result.stderr.splitlines() if "error:" in text)
    assert "worker rank 1 failed" in line and "planted failure at step 6" in line and "ddp_plain.py:" in line
    record = load_run_profile(run_dir)
    assert record.script is not None and not record.script.complete
    assert 1 in record.script.ranks_reported and record.steps >= 5


def test_fsdp_without_ddp_says_what_could_not_be_seen(tmp_path: Path) -> None:
    run_dir = tmp_path / "fsdp"
    result = cli_in_process("launch", "--slots", "2", "--run-dir", str(run_dir), str(SCRIPTS / "fsdp_synthetic.py"),
                            "--steps", "8")
    assert result.code == 0, result.stderr
    record = load_run_profile(run_dir)
    assert record.script is not None and record.script.models == [] and record.script.unseen[0] == NO_DDP
    assert record.slots == 2 and record.steps == 8 and record.unobserved_phases == ["comm_exposed"]
    assert json.loads((run_dir / "script.json").read_text())["unseen"] == record.script.unseen
    diagnosis = diagnose(record)  # the data wait and the rest, and the one line on what was not seen
    assert not diagnosis.phases_observed and NO_DDP in diagnosis.verdict
