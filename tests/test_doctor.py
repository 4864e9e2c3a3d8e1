"""The doctor names planted bottlenecks, and refuses bad input with one line."""

import json
import shutil

import pytest
from helpers import TRIALS, cli_in_process, dtrain_cli, tiny_config

PLANTED = {
    "data_loading": ("planted:SlowDataTrial", {"load_seconds": 0.003, "global_batch_size": 8}),
    "communication": ("planted:WideTrial", {"wide_params": 3_000_000, "global_batch_size": 8}),
    "straggler": ("planted:StragglerTrial", {"slow_rank": 1, "sleep_seconds": 0.02, "global_batch_size": 8}),
}


@pytest.mark.parametrize("expected", list(PLANTED))
def test_planted_bottleneck_is_named(tmp_path, expected):
    entrypoint, hparams = PLANTED[expected]
    shutil.copy(TRIALS / "planted.py", tmp_path / "planted.py")
    cfg = tiny_config(tmp_path, entrypoint=entrypoint, hyperparameters=hparams, max_length={"batches": 40},
                      scheduling_unit=40)
    result = dtrain_cli("run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet")
    assert result.code == 0, result.stderr
    doctor = cli_in_process("doctor", str(tmp_path / "r"), "--json")
    assert doctor.code == 0, doctor.stderr
    diagnosis = json.loads(doctor.stdout)
    shares = {f["factor"]: round(f["share"], 2) for f in diagnosis["factors"]}
    assert diagnosis["top_factor"] == expected, shares
    assert diagnosis["recommendations"], diagnosis
    assert all(r["key"] and r["predicted_speedup"] > 1 for r in diagnosis["recommendations"])
    if expected == "straggler":
        assert "rank 1" in diagnosis["factors"][0]["why"]


def _one_line(result, fragment):
    assert result.code == 2, result
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_doctor_bad_input(tmp_path):
    _one_line(cli_in_process("doctor", str(tmp_path / "missing")), "is not a directory")
    _one_line(cli_in_process("doctor", str(tmp_path)), "is not a dtrain run")
    (tmp_path / "config.yaml").write_text("name: x\n")
    _one_line(cli_in_process("doctor", str(tmp_path)), "has no profile.json yet")
    (tmp_path / "profile.json").write_text("")
    _one_line(cli_in_process("doctor", str(tmp_path)), "is empty or corrupt")
    (tmp_path / "profile.json").write_text('{"schema_version": 1, "per_rank": []}')
    _one_line(cli_in_process("doctor", str(tmp_path)), "is empty or corrupt")


def test_bench_bad_slots(tmp_path):
    cfg = tiny_config(tmp_path)
    _one_line(cli_in_process("bench", str(cfg), "--slots", "0,2"), "'0' is not a positive integer")
    _one_line(cli_in_process("bench", str(cfg), "--slots", "one"), "positive integers")
    _one_line(cli_in_process("bench", str(cfg), "--steps", "0"), "expected a positive integer")
