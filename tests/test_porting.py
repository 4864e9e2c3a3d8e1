"""docs/porting.md: its diff is the files' diff, and the ported script runs under every launcher."""

from __future__ import annotations

import difflib
import re

import pytest
from helpers import ROOT, cli_with_workers, python_command

TORCHRUN = ROOT / "examples" / "porting" / "torchrun_ddp.py"
PORTED = ROOT / "examples" / "porting" / "dtrain_version.py"


def _diff() -> str:
    old, new = (p.read_text().splitlines(keepends=True) for p in (TORCHRUN, PORTED))
    return "".join(difflib.unified_diff(old, new, str(TORCHRUN.relative_to(ROOT)), str(PORTED.relative_to(ROOT))))


def test_the_documented_diff_is_the_diff_of_the_files():
    doc = (ROOT / "docs" / "porting.md").read_text()
    shown = re.search(r"```diff\n(.*?)```", doc, re.S)
    assert shown is not None and shown.group(1) == _diff(), "regenerate the diff in docs/porting.md"
    lines = _diff().splitlines()
    added = sum(ln.startswith("+") and not ln.startswith("+++") for ln in lines)
    removed = sum(ln.startswith("-") and not ln.startswith("---") for ln in lines)
    assert f"({added} and {removed} with the docstrings)" in doc  # the numbers the page quotes


@pytest.mark.slow
def test_ported_script_runs_under_dtrain_launch_torchrun_and_python(tmp_path, capfd):
    snapshots = str(tmp_path / "snapshots")
    script = [str(PORTED), "--max-steps", "3", "--snapshot", snapshots]
    # dtrain's launcher in this process (the workers are new processes: what they print is read with capfd).
    launched = cli_with_workers(capfd, "launch", "--slots", "2", "--run-dir", str(tmp_path / "run"), *script,
                                "--epochs", "1")
    out, err = launched.stdout, launched.stderr
    assert launched.code == 0, err
    assert "epoch 0: loss" in out and "on 2 slot(s)" in out, out
    assert "seeded alike on all 2 rank(s)" in err, err  # init says what it seeds
    # One worker under torchrun (each costs seconds of imports): the checkpoint of 2 slots resumes on 1, and
    # two workers meeting under torch's agent is every `dtrain launch` above.
    torchrun = python_command("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *script,
                              "--epochs", "2")
    assert torchrun.code == 0, torchrun.stderr
    assert "epoch 0:" not in torchrun.stdout and "epoch 1: loss" in torchrun.stdout  # resumed
    assert "on 1 slot(s)" in torchrun.stdout
    alone = python_command(*script, "--epochs", "3")
    assert alone.code == 0, alone.stderr
    assert "epoch 1:" not in alone.stdout and "epoch 2: loss" in alone.stdout and "on 1 slot(s)" in alone.stdout
    # Resumed across slot counts (under torchrun): this model has no dropout, so nothing differs from an
    # uninterrupted 1-slot run and the restore says so at INFO only (dtrain.engine.state.TrainingState.
    # _log_layout_change), not on stderr.
    assert "Traceback" not in alone.stderr and "Traceback" not in torchrun.stderr
