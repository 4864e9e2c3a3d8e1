"""``dtrain doctor RUN --try KEY=VALUE --verify``: each tried change predicted and measured by a short run beside
the same round's baseline; the point's error and whether the 80% interval held the measurement."""

import json

import pytest
from helpers import PROBED, cli_in_process, tiny_config

from dtrain.explain import verify as verify_mod


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One profiled 2-slot run of the tiny trial (global batch 16)."""
    tmp = tmp_path_factory.mktemp("verifytry")
    cfg = tiny_config(tmp, max_length={"batches": 40}, scheduling_unit=40, **PROBED)
    result = cli_in_process("run", str(cfg), "--run-dir", str(tmp / "r"), "--quiet")
    assert result.code == 0, result.stderr
    return tmp / "r"


@pytest.mark.slow
def test_tried_changes_are_predicted_and_measured(run):
    tries = ["precision=bf16-mixed", "hyperparameters.global_batch_size=32", "seed=4"]
    # Short runs of 10 steps, not the 2 s each that honest figures take: this checks the figures' plumbing.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify_mod, "MIN_SECONDS", 0.0)
        result = cli_in_process("doctor", str(run), *[a for t in tries for a in ("--try", t)], "--verify",
                                "--repeats", "2", "--steps", "10", "--json")
    assert result.code == 0, result.stderr
    doc = json.loads(result.stdout)
    rows = {r["try"]: r for r in doc["tried"]}
    assert list(rows) == tries and doc["rounds"] == 2 and doc["tuned_config"] is None
    assert len(doc["baseline_runs"]) == 2
    for r in rows.values():
        assert r["sets"] == [r["try"]] and len(r["samples_per_second_runs"]) == 2
        ratios = [x / b for x, b in zip(r["samples_per_second_runs"], doc["baseline_runs"], strict=True)]
        assert r["speedup_ratios"] == pytest.approx(ratios)
        assert r["speedup_range"] == pytest.approx([min(ratios), max(ratios)])
        assert r["measured_speedup"] == pytest.approx(sum(ratios) / 2)
        if r["predicted_speedup"] is None:
            assert r["reason"].startswith(f"cannot predict {r['key']}") and r["error"] is None, r
            if r["predicted_low"] is None:  # not priced at all
                assert r["interval_held"] is None
            else:  # priced, wider than +/-25%: no point, but the interval is measured against (issue 73)
                assert "to within +/-25%" in r["reason"] and "--verify" in r["reason"], r
                assert r["interval_held"] == (r["predicted_low"] <= r["measured_speedup"] <= r["predicted_high"])
            continue
        # (its top may be the point: a step held at linear scaling from one slot, as in test_try.py)
        assert r["predicted_low"] < r["predicted_speedup"] <= r["predicted_high"], r
        assert r["error"] == pytest.approx((r["predicted_speedup"] - r["measured_speedup"]) / r["measured_speedup"])
        assert r["interval_held"] == (r["predicted_low"] <= r["measured_speedup"] <= r["predicted_high"])
    # The batch the model prices from the run's own batch probe: a prediction, in samples/s, with the
    # learning rate left as it was said.
    batch = rows["hyperparameters.global_batch_size=32"]
    assert batch["predicted_speedup"] is not None
    assert "samples/s, not steps/s" in batch["note"] and "learning rate was left" in batch["note"]
    # A change the model does not price is measured all the same.
    assert rows["seed=4"]["measured_speedup"] > 0 and "does not price it" in rows["seed=4"]["reason"]
    assert rows["precision=bf16-mixed"]["note"] is None

    text = verify_mod.render_tries(doc)
    assert "predicted (80% interval)" in text and "no prediction" in text and "learning rate was left" in text
    assert "interval held" in text and "no tuned.yaml written" in text


@pytest.mark.parametrize("args, fragment", [
    (["--try", "no_such_key=1"], "no_such_key"),
    (["--try", "precision"], "--try expects KEY=VALUE"),
    (["--try", "nodes=2"], "cannot add hosts"),
    (["--try", "hyperparameters.global_batch_size=33"], "must split evenly"),
    (["--try", "precision=bf16-mixed", "--steps", "5"], "at least 10 steps"),
])
def test_a_refused_try_is_one_line_before_any_run(run, args, fragment):
    before = set(run.iterdir())
    result = cli_in_process("doctor", str(run), *args, "--verify")
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.code == 2 and len(lines) == 1 and fragment in lines[0], result
    assert set(run.iterdir()) == before  # no verify session folder: nothing ran


def test_error_and_interval_held_from_faked_measurements(run, monkeypatch):
    """Short runs faked: the batch try measures 4x its baseline (beyond any interval the model gives it), the
    seed try 1x; the figures follow from those and from the same predictions as ``doctor --try``."""
    figures = {"baseline": 100.0, "hyperparameters.global_batch_size=32": 400.0, "seed=4": 100.0}
    monkeypatch.setattr(verify_mod, "_short_run", lambda config, exp, *rest: figures[exp.action])
    lines = []
    doc = verify_mod.verify_tries(run, list(figures)[1:], steps=10, repeats=1, log=lines.append)
    predicted = json.loads(cli_in_process("doctor", str(run), "--json", "--try",
                                          "hyperparameters.global_batch_size=32").stdout)["tries"][0]
    batch, seed = doc["tried"]
    assert batch["predicted_speedup"] == pytest.approx(predicted["gain"]) and batch["measured_speedup"] == 4.0
    assert batch["error"] == pytest.approx(predicted["gain"] / 4.0 - 1.0) and batch["interval_held"] is False
    assert seed["measured_speedup"] == 1.0 and seed["error"] is None and seed["speedup_range"] == [1.0, 1.0]
    assert doc["rounds"] == 1 and any("steps per run instead of 10" in line for line in lines)
    text = verify_mod.render_tries(doc)
    assert "4.00x" in text and f"{100 * batch['error']:+.0f}%" in text and "noise of unknown size" in text
