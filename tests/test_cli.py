"""Bad input: one clear line, exit code 2, no traceback, nothing destroyed. And `dtrain launch`."""

import os
import sys
from pathlib import Path

import pytest
from helpers import ROOT, cli_in_process, cli_with_workers, dtrain_cli, tiny_config, write


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
    ({"entrypoint": "tiny:Unfinished"}, "Unfinished does not define train_batch, which every Trial needs"),
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
    assert cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet", "--slots", "1").code == 0
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    _assert_one_line_error(cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "r")), "already holds a run")
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_data_error_inside_workers_is_one_line(tmp_path, capfd):
    # 8 training records cannot fill one global batch of 16: found by the workers, reported once.
    cfg = tiny_config(tmp_path, **{"hyperparameters.train_size": 8})
    result = cli_with_workers(capfd, "run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet")
    _assert_one_line_error(result, "the training data has 8 records, fewer than 16")


@pytest.mark.slow
def test_launch_runs_your_own_loop_and_resumes(tmp_path, capfd):
    # The launcher in this process (no interpreter of its own to start); the script's workers are new
    # processes that write to this test's captured descriptors, read with capfd. One slot, then two: the
    # checkpoint of one slot count is resumed on another, and only the second launch pays for two workers.
    script = ROOT / "examples" / "own_loop" / "train.py"
    ckpt = tmp_path / "ckpt"
    result = cli_with_workers(capfd, "launch", "--slots", "1", "--run-dir", str(tmp_path / "run1"), str(script),
                              "--epochs", "1", "--checkpoint-dir", str(ckpt))
    out = result.stdout
    assert result.code == 0, result.stderr
    assert "epoch 0: loss" in out and "on 1 slot(s)" in out, out
    result = cli_with_workers(capfd, "launch", "--slots", "2", "--run-dir", str(tmp_path / "run2"), str(script),
                              "--epochs", "2", "--checkpoint-dir", str(ckpt))
    out = result.stdout
    assert result.code == 0, result.stderr
    assert "epoch 0:" not in out and "epoch 1: loss" in out and "on 2 slot(s)" in out, out
    _assert_one_line_error(cli_in_process("launch", "--slots", "2", str(tmp_path / "nope.py")), "does not exist")


# ------------------------------------------------------------------------------ rough edges (issue 16)


def _profiled_run(tmp_path):
    # test_report.py's builders; its folder is on sys.path only once pytest has collected it, so add it here
    # for a run of this file alone.
    here = str(Path(__file__).parent / "explain")
    if here not in sys.path:
        sys.path.append(here)
    from test_report import _profile, _records, make_run

    return make_run(tmp_path / "run", profile=_profile(), records=_records())


def test_debug_is_accepted_before_or_after_the_command(tmp_path):
    from dtrain.cli import build_parser

    run_dir = _profiled_run(tmp_path)
    for argv in (["--debug", "doctor", str(run_dir)], ["doctor", str(run_dir), "--debug"]):
        result = cli_in_process(*argv)
        assert result.code == 0 and "verdict" in result.stdout, (argv, result.stderr)
    parser = build_parser()
    assert parser.parse_args(["run", "x.yaml", "--debug"]).debug is True
    assert parser.parse_args(["--debug", "run", "x.yaml"]).debug is True
    assert parser.parse_args(["run", "x.yaml"]).debug is False
    for command in ("k8s x.yaml --image i --nnodes 2 --debug", "slurm x.yaml --nodes 2 --debug",
                    "bench x.yaml --debug"):
        assert parser.parse_args(command.split()).debug is True, command
    script_flag = parser.parse_args(["launch", "--slots", "2", "train.py", "--debug"])  # the script's own flag
    assert script_flag.args == ["--debug"] and script_flag.debug is False


def test_debug_shows_the_traceback_and_keeps_exit_code_2(tmp_path):
    result = cli_in_process("run", str(tiny_config(tmp_path, **{"resources.slots_per_trail": 2})), "--debug")
    assert result.code == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("dtrain: error: ")


def test_a_directory_given_as_config_says_it_is_a_directory(tmp_path):
    tiny_config(tmp_path)
    result = cli_in_process("run", str(tmp_path))
    _assert_one_line_error(result, "is a directory; pass the experiment YAML file itself (there: experiment.yaml)")
    _assert_one_line_error(cli_in_process("bench", str(tmp_path)), "is a directory")


def test_a_missing_package_in_trial_code_is_named_with_its_install(tmp_path):
    write(tmp_path / "needs_pkg.py", """\
        import dtrain_no_such_package_xyz  # noqa: F401
        """)
    result = cli_in_process("run", str(tiny_config(tmp_path, entrypoint="needs_pkg:Trial")))
    _assert_one_line_error(result, "module 'needs_pkg' imports 'dtrain_no_such_package_xyz', which is not installed")
    assert "pip install dtrain_no_such_package_xyz" in result.stderr
    assert "beside the config" not in result.stderr


def test_report_rebuilds_the_page_and_prints_the_time_table(tmp_path):
    run_dir = _profiled_run(tmp_path)
    result = cli_in_process("report", str(run_dir))
    assert result.code == 0, result.stderr
    assert "time cost per step (2 slot(s)" in result.stdout and "doctor: " in result.stdout
    assert result.stdout.splitlines()[-1] == f"dtrain: report {run_dir / 'report.html'}"
    assert (run_dir / "report.html").read_text().startswith("<!DOCTYPE html>")
    quiet = cli_in_process("report", str(run_dir), "--quiet")
    assert quiet.code == 0 and quiet.stdout.splitlines() == [f"dtrain: report {run_dir / 'report.html'}"]
    (tmp_path / "empty").mkdir()
    _assert_one_line_error(cli_in_process("report", str(tmp_path / "empty")), "is not a run directory")
    _assert_one_line_error(cli_in_process("report", str(tmp_path / "nope")), "is not a directory")


@pytest.mark.slow
def test_quiet_run_ends_in_one_line_and_warns_once(tmp_path, report_page):
    # 15 records on 2 slots: the remainder warning, from the launcher only (workers stay silent about it). A
    # process of its own: --debug sets up the logging of the process it runs in.
    cfg = tiny_config(tmp_path, **{"hyperparameters.global_batch_size": 15, "max_length": {"batches": 2}})
    result = dtrain_cli("run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet", "--debug")
    assert result.code == 0, result.stderr  # --debug after the command, and a success exits 0
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtrain: done in "), result.stdout
    assert lines[0].endswith(f"; report {tmp_path / 'r' / 'report.html'}")
    assert result.stderr.count("is not divisible by 2 slots") == 1, result.stderr


def test_a_report_that_cannot_be_written_is_one_warning_and_the_run_still_succeeds(tmp_path, report_page):
    """What dtrain adds after the training (the summary, report.html) never fails a run that trained."""
    cfg = tiny_config(tmp_path, **{"max_length": {"batches": 4}})
    (tmp_path / "r" / "report.html").mkdir(parents=True)  # where the page goes: it cannot be written
    result = cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet")
    assert result.code == 0, result.stderr
    assert result.stderr.splitlines() == [
        "dtrain: warning: summarizing the run failed (IsADirectoryError: [Errno 21] Is a directory: "
        f"'{tmp_path / 'r' / 'report.html.partial'}' -> '{tmp_path / 'r' / 'report.html'}'); it trained and its files "
        f"are written: 'dtrain report {tmp_path / 'r'}' tries the page again"], result.stderr
    assert (tmp_path / "r" / "summary.json").is_file() and (tmp_path / "r" / "checkpoints" / "latest").is_file()


def test_launch_passes_the_scripts_exit_code_through(tmp_path):
    script = tmp_path / "bad_args.py"
    script.write_text("import sys\nprint('usage: bad_args.py N', file=sys.stderr)\nsys.exit(2)\n")
    result = cli_in_process("launch", "--slots", "1", "--run-dir", str(tmp_path / "run"), str(script))
    assert result.code == 2, (result.code, result.stderr)
    assert "code 2" in result.stderr


@pytest.mark.parametrize(("change", "fragment"), [
    ("precision=fp8", "precision: got 'fp8' (str); expected '32-true'"),
    ("resources.slots_per_trail=2", "did you mean 'resources.slots_per_trial'?"),
    ("data_loader.num_workers=-1", "data_loader.num_workers: got -1"),
    ("hyperparameters.global_batch_size=63", "must split evenly over the run's 2 slot(s)"),
    ("nodes=many", "nodes must be a whole number"),
    ("precision", "--try expects KEY=VALUE"),
])
def test_doctor_try_bad_input(tmp_path, change, fragment):
    """``--try`` reads a change as ``--set`` does and checks it by the config's schema: one line, exit 2,
    before anything is predicted (no worker starts: a profile written by hand)."""
    from profiles import make_profile
    from profiles import write as write_profile

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(tiny_config(tmp_path).read_text())
    step = {"data": 0.001, "forward": 0.004, "backward": 0.004, "comm_exposed": 0.002, "optimizer": 0.001}
    write_profile(run, make_profile([step, step], "vm"))
    _assert_one_line_error(cli_in_process("doctor", str(run), "--try", change), fragment)
    # Measuring it (--verify) refuses it the same way, before any short run.
    _assert_one_line_error(cli_in_process("doctor", str(run), "--try", change, "--verify"), fragment)
    assert [p.name for p in run.iterdir() if p.name.startswith("verify-")] == []
