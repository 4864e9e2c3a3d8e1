"""``dtrain doctor --verify``: the doctor's advice measured on planted bottlenecks, and bad input."""

import json
import shutil

import pytest
import yaml
from helpers import TRIALS, cli_in_process, tiny_config

PLANTED = {
    # Each record sleeps 2 ms (a slow disk): 32 ms per 16-record slot batch, next to ~1 ms of compute.
    "slow-data": ("planted:SlowDataTrial", {"load_seconds": 0.002, "global_batch_size": 32}, "data_loading"),
    # One record per slot: every step is mostly all-reduce latency and optimizer overhead.
    "small-batch": ("planted:PlainTrial", {"global_batch_size": 2, "lr": 0.01}, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PLANTED))
def test_verify_measures_the_recommended_change(tmp_path, case):
    entrypoint, hparams, factor = PLANTED[case]
    shutil.copy(TRIALS / "planted.py", tmp_path / "planted.py")
    cfg = tiny_config(tmp_path, entrypoint=entrypoint, hyperparameters=hparams, max_length={"batches": 40},
                      scheduling_unit=40)
    run = tmp_path / "r"
    result = cli_in_process("run", str(cfg), "--run-dir", str(run), "--quiet")
    assert result.code == 0, result.stderr
    diagnosis = json.loads(cli_in_process("doctor", str(run), "--json").stdout)
    if factor is not None:
        assert diagnosis["top_factor"] == factor
    first = diagnosis["recommendations"][0]
    verified = cli_in_process("doctor", str(run), "--verify", "--steps", "40", "--top", "1", "--json")
    assert verified.code == 0, verified.stderr
    doc = json.loads(verified.stdout)
    rows = {r["action"]: r for r in doc["verified"]}
    assert first["action"] in rows, rows
    measured = rows[first["action"]]["measured_speedup"]
    assert measured >= 1.3, (first, doc)
    assert rows[first["action"]]["predicted_speedup"] == pytest.approx(first["predicted_speedup"])
    assert {r["kind"] for r in doc["verified"]} == {"recommendation", "bisection"}
    # Best measured first; tuned.yaml holds the best measured recommendation, a loadable config.
    speeds = [r["measured_speedup"] for r in doc["verified"]]
    assert speeds == sorted(speeds, reverse=True)
    tuned = yaml.safe_load((run / "tuned.yaml").read_text())
    best = next(r for r in doc["verified"] if r["kind"] == "recommendation")
    key, value = best["sets"][0].split("=", 1)
    node = tuned
    for part in key.split("."):
        node = node[part]
    assert str(node) == value
    assert cli_in_process("check", str(run / "tuned.yaml")).code == 0


def test_verify_bad_input(tmp_path):
    cfg = tiny_config(tmp_path)
    result = cli_in_process("doctor", str(tmp_path / "missing"), "--verify")
    assert result.code == 2 and "is not a directory" in result.stderr
    assert cli_in_process("doctor", str(cfg.parent), "--verify", "--steps", "0").code == 2
