"""Bad input: one clear line, exit code 2, no traceback, nothing destroyed. And `dtrain launch`."""

import os

import pytest
from helpers import ROOT, cli_in_process, dtrain_cli, tiny_config, write


def _assert_one_line_error(result, fragment):
    assert result.code == 2, (result.code, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("dtrain: error: ") and fragment in lines[0], lines[0]


@pytest.mark.parametrize(("overrides", "fragment"), [
    ({"resources.slots_per_trail": 2}, "did you mean 'resources.slots_per_trial'?"),
    ({"max_length": {"batches": "many"}}, "max_length.batches: got 'many' (str)"),
    ({"entrypoint": "nosuchmodule:Trial"}, "cannot import module 'nosuchmodule'"),
    ({"entrypoint": "tiny:Missing"}, "has no 'Missing'; Trials there: TinyTrial"),
    ({"entrypoint": "tiny:NotATrial"}, "NotATrial is not a subclass of dtrain.PyTorchTrial"),
    ({"hyperparameters.global_batch_size": 1}, "smaller than slots_per_trial 2"),
    ({"backend": "nccl"}, "backend 'nccl' needs CUDA GPUs"),
])
def test_bad_config(tmp_path, overrides, fragment):
    result = cli_in_process("run", str(tiny_config(tmp_path, **overrides)), "--run-dir", str(tmp_path / "r"))
    _assert_one_line_error(result, fragment)
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


def test_bad_cli_arguments(tmp_path):
    cfg = tiny_config(tmp_path)
    _assert_one_line_error(cli_in_process("run", str(cfg), "--slots", "0"), "expected a positive integer, got 0")
    _assert_one_line_error(cli_in_process("run", str(cfg), "--set", "oops"), "--set expects KEY=VALUE")
    _assert_one_line_error(cli_in_process("run", str(tmp_path / "none.yaml")), "does not exist")
    _assert_one_line_error(cli_in_process("frobnicate"), "invalid choice")
    bad = write(tmp_path / "bad.yaml", "name: [unclosed\n")
    _assert_one_line_error(cli_in_process("run", str(bad)), "malformed YAML at line")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_run_dir_as_user(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    result = cli_in_process("run", str(tiny_config(tmp_path)), "--run-dir", str(locked / "r"))
    _assert_one_line_error(result, "cannot write run directory")


def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = cli_in_process("run", str(tiny_config(tmp_path)), "--run-dir", str(blocker / "r"))
    _assert_one_line_error(result, "cannot write run directory")


@pytest.mark.slow
def test_existing_run_is_not_overwritten(tmp_path):
    cfg = tiny_config(tmp_path, **{"max_length": {"batches": 2}})
    assert dtrain_cli("run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet", "--slots", "1").code == 0
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    _assert_one_line_error(dtrain_cli("run", str(cfg), "--run-dir", str(tmp_path / "r")), "already holds a run")
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_data_error_inside_workers_is_one_line(tmp_path):
    # 8 training records cannot fill one global batch of 16: found by the workers, reported once.
    cfg = tiny_config(tmp_path, **{"hyperparameters.train_size": 8})
    result = dtrain_cli("run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet")
    _assert_one_line_error(result, "the training data has 8 records, fewer than 16")


@pytest.mark.slow
def test_launch_runs_your_own_loop_and_resumes(tmp_path):
    script = ROOT / "examples" / "own_loop" / "train.py"
    ckpt = tmp_path / "ckpt"
    result = dtrain_cli("launch", "--slots", "2", str(script), "--epochs", "2", "--checkpoint-dir", str(ckpt))
    assert result.code == 0, result.stderr
    assert "epoch 1: loss" in result.stdout and "on 2 slot(s)" in result.stdout
    result = dtrain_cli("launch", "--slots", "2", str(script), "--epochs", "3", "--checkpoint-dir", str(ckpt))
    assert result.code == 0, result.stderr
    assert "epoch 0:" not in result.stdout and "epoch 2: loss" in result.stdout
    _assert_one_line_error(dtrain_cli("launch", "--slots", "2", str(tmp_path / "nope.py")), "does not exist")
