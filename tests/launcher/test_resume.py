"""``--resume`` from the launcher's side, in-process (no worker starts): the run's own settings are the
default, a changed setting is named before anything trains, a run with nothing trained frees its directory,
and the advice printed after a stop or a failure matches what the run left."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import cli_in_process, tiny_config

from dtrain.config.schema import load_config
from dtrain.errors import UserError
from dtrain.launcher import resume, runs


def _prepare(*args, **kwargs):
    plan = runs.prepare(*args, **kwargs)
    if plan.lock is not None:
        plan.lock.release()
    return plan


def _started(tmp_path: Path, *overrides: str) -> tuple[Path, Path]:
    """A run directory as ``dtrain run CONFIG --set ...`` leaves it before its first checkpoint."""
    cfg = tiny_config(tmp_path)
    run_dir = tmp_path / "r"
    _prepare(cfg, list(overrides), run_dir, None)
    return cfg, run_dir


def _fake_checkpoint(run_dir: Path, batches: int) -> None:
    (run_dir / "checkpoints" / str(batches)).mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text(str(batches))


def test_resume_without_config_keeps_the_runs_own_settings(tmp_path, capsys):
    _, run_dir = _started(tmp_path, "resources.slots_per_trial=1", "max_length.batches=40",
                          "hyperparameters.train_size=128")
    capsys.readouterr()
    plan = _prepare(None, [], None, run_dir)
    assert plan.run_dir == run_dir
    assert plan.config.resources.slots_per_trial == 1 and plan.config.max_length.batches == 40
    assert plan.config.hyperparameters["train_size"] == 128
    assert "differ" not in capsys.readouterr().err  # nothing changes: nothing to say


def test_a_resume_that_changes_settings_names_them_first(tmp_path, capsys):
    cfg, run_dir = _started(tmp_path, "resources.slots_per_trial=1", "max_length.batches=40")
    capsys.readouterr()
    plan = _prepare(cfg, ["hyperparameters.train_size=128"], None, run_dir)  # the file: 2 slots, 24 batches
    assert plan.config.resources.slots_per_trial == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "max_length {batches: 40} -> {batches: 24}; resources.slots_per_trial 1 -> 2; " in err
    assert "hyperparameters.train_size 256 -> 128" in err
    assert f"'dtrain run --resume {run_dir}' alone keeps the run's settings" in err
    assert err.index("max_length") < err.index("train_size")  # length and slots first


def test_resume_without_config_or_run_dir_is_one_line(tmp_path):
    result = cli_in_process("run")
    assert result.code == 2 and "dtrain run needs CONFIG" in result.stderr and "--resume RUN_DIR" in result.stderr
    missing = cli_in_process("run", "--resume", str(tmp_path / "nowhere"))
    assert missing.code == 2 and "no such directory" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1 and "Traceback" not in missing.stderr
    (tmp_path / "empty").mkdir()
    empty = cli_in_process("run", "--resume", str(tmp_path / "empty"))
    assert empty.code == 2 and "no config.yaml there" in empty.stderr
    assert f"dtrain run CONFIG --resume {tmp_path / 'empty'}" in empty.stderr


def test_a_run_that_kept_nothing_frees_its_directory(tmp_path, caplog):
    cfg, run_dir = _started(tmp_path, "max_length.batches=40")
    _prepare(cfg, [], run_dir, None)  # the first failed before its first checkpoint: start again there
    assert "nothing trained is kept there" in caplog.text
    assert load_config(run_dir / "config.yaml").max_length.batches == 24  # the new run's config
    assert list(run_dir.glob("config.before-resume-*.yaml"))  # the old one kept beside it
    _fake_checkpoint(run_dir, 8)
    with pytest.raises(UserError, match=f"already holds a run; continue it with dtrain run --resume {run_dir}"):
        _prepare(cfg, [], run_dir, None)


def test_finished_run_is_recognised_in_epochs_from_the_checkpoint(tmp_path):
    cfg = load_config(tiny_config(tmp_path, **{"max_length": {"epochs": 2}}))
    resume.check_not_finished(tmp_path, cfg, 31, {"batches_per_epoch": 16})  # one batch to go: fine
    with pytest.raises(resume.AlreadyFinished, match="it trained 32 batches"):
        resume.check_not_finished(tmp_path, cfg, 32, {"batches_per_epoch": 16})
    resume.check_not_finished(tmp_path, cfg, 1000, {})  # unknown epoch length: the worker decides


def test_advice_matches_what_the_run_left(tmp_path):
    cfg, run_dir = _started(tmp_path)
    plan = _prepare(cfg, [], run_dir, run_dir)
    advice = resume.resume_advice(plan)
    assert advice.startswith("no checkpoint was written, so there is nothing to resume") and "resume with" not in advice
    assert f"a new 'dtrain run CONFIG --run-dir {run_dir}' (the directory is free for it)" in advice
    _fake_checkpoint(run_dir, 8)
    assert resume.resume_advice(plan) == f"resume with: dtrain run --resume {run_dir}"


def test_resume_parses_without_config():
    from dtrain.cli import build_parser

    args = build_parser().parse_args(["run", "--resume", "runs/r", "--slots", "2"])
    assert args.config is None and args.resume == Path("runs/r")
    with pytest.raises(UserError):
        resume.config_path(None, None)


def test_a_job_that_stopped_cleanly_says_so_without_an_error(tmp_path, monkeypatch):
    # An elastic job left with fewer nodes than --nnodes's minimum: every rank stopped at a checkpoint.
    from dtrain.engine.failures import Failure

    cfg = tiny_config(tmp_path)
    stopped = Failure(0, 1, "the job stopped: node b left the job: 1 node(s) remain, fewer than --nnodes's minimum 2",
                      user_error=False, standalone=True, clean_stop=True)

    def execute(plan, quiet, debug, threads=None):
        _fake_checkpoint(plan.run_dir, 8)
        return stopped

    monkeypatch.setattr(runs, "execute", execute)
    result = cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet")
    assert result.code == 1 and "error" not in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"dtrain: {stopped.message}; resume with: dtrain run --resume {tmp_path / 'r'}")


def test_a_finished_run_counted_in_epochs_is_advised_in_epochs_and_the_advice_works(tmp_path):
    """The config gives epochs: advice in batches would be refused ("give exactly one of 'batches' or
    'epochs'"), as would docs/config.md's example followed literally."""
    import torch

    from dtrain.engine import checkpoint

    cfg = tiny_config(tmp_path, max_length={"epochs": 1})
    run_dir = tmp_path / "r"
    _prepare(cfg, [], run_dir, None)
    payload = checkpoint.CheckpointPayload(16, [{"w": torch.ones(2)}], [], {"extra": {
        "batches": 16, "batches_per_epoch": 16}}, {"world_size": 2})
    checkpoint.save(run_dir / "checkpoints", payload, {"batches": 16, "rng": {}}, 0, keep_last=2)
    with pytest.raises(resume.AlreadyFinished) as finished:
        _prepare(None, [], None, run_dir)
    advice = str(finished.value)
    assert "(max_length {epochs: 1})" in advice and advice.endswith("e.g. --set max_length.epochs=2"), advice
    plan = _prepare(None, [advice.rsplit("--set ", 1)[1]], None, run_dir)  # followed: accepted, resumes at 16
    assert plan.config.max_length.epochs == 2 and plan.resume_from == run_dir / "checkpoints" / "16"
    result = cli_in_process("run", "--resume", str(run_dir), "--set", "max_length.batches=32")
    assert result.code == 2 and "give exactly one of 'batches' or 'epochs'" in result.stderr
