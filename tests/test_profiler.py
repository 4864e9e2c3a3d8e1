"""The step profiler's arithmetic, on a real 2-slot run, and its unit pieces."""

import json

from helpers import dtrain_cli, tiny_config

from dtrain.profiling import PHASES, CommRecorder


def test_busy_time_is_the_union_of_intervals():
    rec = CommRecorder()
    rec.launches = [0.0, 1.0, 5.0]
    rec.completions = [2.0, 3.0, 6.0]
    assert rec.busy_seconds() == 4.0  # [0,3] + [5,6]
    assert rec.busy_seconds(lo=2.5, hi=5.5) == 1.0  # [2.5,3] + [5,5.5]


def test_phases_add_up_and_exposed_never_exceeds_busy(tmp_path):
    cfg = tiny_config(tmp_path, **{"max_length": {"batches": 60}, "hyperparameters.train_size": 1024})
    result = dtrain_cli("run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet")
    assert result.code == 0, result.stderr
    profile = json.loads((tmp_path / "r" / "profile.json").read_text())
    assert profile["slots"] == 2 and profile["profiled_steps"] == 60 - 3
    params = 8 * 16 + 16 + 16 + 1
    for rank in profile["per_rank"]:
        phases = rank["seconds_per_step"]
        total = sum(phases[p] for p in PHASES)
        assert abs(total - phases["step"]) <= 0.03 * phases["step"], (total, phases["step"])
        assert phases["comm_exposed"] <= rank["comm_busy_seconds_per_step"] + 1e-9
        assert rank["comm_bytes_per_step"] == params * 4  # every gradient, fp32, once per step
        assert rank["comm_buckets_per_step"] >= 1
    spread = profile["seconds_per_step"]["step"]
    assert spread["min"] <= spread["mean"] <= spread["max"]
    assert profile["comm"]["algbw_bytes_per_second"] > 0
    assert "time cost per step" in result.stdout and "doctor:" in result.stdout


def test_profiling_off_writes_no_profile(tmp_path):
    cfg = tiny_config(tmp_path, **{"max_length": {"batches": 10}, "profiling.enabled": False})
    result = dtrain_cli("run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet")
    assert result.code == 0, result.stderr
    assert not (tmp_path / "r" / "profile.json").exists()
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["samples_per_second"] > 0
