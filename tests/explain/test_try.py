"""``dtrain doctor RUN --try KEY=VALUE``: every change the cost model knows is predicted on a real run, by the
same model call as the doctor's table and ``dtrain plan``'s row for it (one model, one answer)."""

import json

import pytest
from helpers import PROBED, cli_in_process, tiny_config

from dtrain.explain import precision
from dtrain.profiling.record import load_run_profile

KNOBS = ["precision=bf16-mixed", "hyperparameters.global_batch_size=32", "resources.slots_per_trial=1",
         "resources.slots_per_trial=4", "nodes=2", "optimizations.aggregation_frequency=4",
         "optimizations.gradient_compression=fp16", "optimizations.gradient_compression=powersgd",
         "optimizations.tensor_fusion_threshold=1000", "data_loader.num_workers=2", "seed=4"]
SOURCES = {"measured", "probed", "given", "assumed", "fitted"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One profiled 2-slot run of the tiny trial, shared by every test here."""
    tmp = tmp_path_factory.mktemp("try")
    cfg = tiny_config(tmp, max_length={"batches": 40}, scheduling_unit=40, **PROBED)
    result = cli_in_process("run", str(cfg), "--run-dir", str(tmp / "r"), "--quiet")
    assert result.code == 0, result.stderr
    return tmp / "r"


def _doctor(run, *args):
    result = cli_in_process("doctor", str(run), "--json", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def tried(run):
    args = [a for knob in KNOBS for a in ("--try", knob)]
    doc = _doctor(run, *args, "--link", "200mbit,0.2ms")
    return doc, {t["try"]: t for t in doc["tries"]}


def test_every_knob_is_predicted_with_its_interval_or_a_reason(run, tried):
    doc, tries = tried
    assert list(tries) == KNOBS
    for t in tries.values():
        if t["gain"] is None:
            assert t["reason"].startswith(f"cannot predict {t['key']}"), t
            continue
        # The top may be the point itself: a step held at linear scaling from one slot (CostModel.predict), which
        # no interval reaches above (seen once in CI: bf16-mixed on 2 slots, 0.844x with its high at 0.844x).
        assert t["low"] < t["gain"] <= t["high"], t
        assert t["samples_per_second"] == pytest.approx(t["gain"] * doc["samples_per_second"])
        assert t["inputs"]["change"] == f"{t['key']}: {t['value']}" and len(t["inputs"]) > 1, t
    # bf16-mixed on this CPU: from the model's own steps timed in it at the end of the run, slower predicted
    # slower; where they were not timed, no figure (a matmul peak would not be one either).
    found = precision.estimate(load_run_profile(run), "bf16-mixed")
    bf16 = tries["precision=bf16-mixed"]
    if found.gain is None:
        assert bf16["gain"] is None and "cannot predict precision: bf16-mixed" in bf16["reason"]
    else:
        assert (bf16["gain"] < 1) == (found.gain < 1) and "measured" in bf16["inputs"]["precision"], bf16
    assert tries["seed=4"]["gain"] is None and "does not price it" in tries["seed=4"]["reason"]
    # The link between hosts was given: two nodes of the run's two slots each (priced; its interval may be wider
    # than +/-25%, then without a point figure).
    assert tries["nodes=2"]["high"] is not None and "200mbit" in tries["nodes=2"]["inputs"]["link between hosts"]
    assert tries["optimizations.tensor_fusion_threshold=1000"]["inputs"]["buckets"].startswith("one")
    # Another thread count and more slots than cores: 4 slots on this run's host cannot beat 1.
    assert tries["resources.slots_per_trial=4"]["high"] < tries["resources.slots_per_trial=1"]["low"]
    # Each priced try carries the model's terms at the run and at the change, each input with its source; the
    # run's terms add up to the step the factor table shows.
    for t in tries.values():
        if t["low"] is None:
            assert t["terms"] == [], t
            continue
        names = [term["name"] for term in t["terms"]]
        assert names[:5] == ["compute", "data", "fixed", "exchange", "late_rank"], names
        assert sum(term["run_seconds"] for term in t["terms"]) == pytest.approx(doc["step_seconds"], rel=1e-6)
        assert all(i["source"] in SOURCES for term in t["terms"] for i in term["inputs"]), t["terms"]
    # An interval wider than +/-25% gives no point figure: it says so, keeps the interval and names --verify.
    for t in tries.values():
        if t["low"] is not None and t["gain"] is None:
            assert "to within +/-25%" in t["reason"] and f"--try {t['try']} --verify" in t["reason"], t
            assert t["high"] > 1.25 * t["low"] and t["samples_per_second"] is None


def test_a_try_and_the_doctor_table_give_one_figure(tried):
    doc, tries = tried
    assert tries["resources.slots_per_trial=1"]["gain"] == pytest.approx(doc["scaling"]["estimated_one_slot_speedup"],
                                                                        rel=1e-12)
    stated, intervals = {}, {}
    for f in doc["factors"]:
        for change in (f, f.get("alternative")):
            if change and change["key"] is not None:
                stated[f"{change['key']}={change['value']}"] = change["predicted_speedup"]
        if f["key"] is not None and "predicted_interval" in f:
            intervals[f"{f['key']}={f['value']}"] = f["predicted_interval"]
    shared = [k for k in stated if k in tries]
    assert "optimizations.aggregation_frequency=4" in shared and "hyperparameters.global_batch_size=32" in shared
    for knob in shared:
        if tries[knob]["gain"] is None:  # wider than +/-25%: the table's interval is the try's
            assert [tries[knob]["low"], tries[knob]["high"]] == pytest.approx(intervals[knob], rel=1e-12), knob
            continue
        assert tries[knob]["gain"] == pytest.approx(stated[knob], rel=1e-12), knob


def test_doctor_and_plan_give_the_identical_figure_for_the_same_change(run, tried):
    """Issue 45: the doctor said one figure for fp16 compression, dtrain plan another. Same run, same change,
    same model call: the same figure, to the last digit."""
    _, tries = tried
    result = cli_in_process("plan", str(run), "--slots", "1,2", "--json")
    assert result.code == 0, result.stderr
    rows = {(r["slots"], r["nodes"], r["change"]): r for r in json.loads(result.stdout)["predictions"]}
    pairs = {"optimizations.gradient_compression=fp16": (2, 1, "gradient_compression: fp16"),
             "optimizations.aggregation_frequency=4": (2, 1, "aggregation_frequency: 4"),
             "resources.slots_per_trial=1": (1, 1, "as measured")}
    for knob, row in pairs.items():
        assert tries[knob]["gain"] == rows[row]["gain"], (knob, tries[knob], rows[row])
    assert rows[(2, 1, "as measured")]["gain"] == 1.0


def test_try_is_printed_in_the_table(run):
    result = cli_in_process("doctor", str(run), "--try", "optimizations.aggregation_frequency=4", "--try",
                            "nodes=2")
    assert result.code == 0, result.stderr
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("try optimizations.aggregation_frequency=4"))
    assert "samples/s" in line and "80%" in line
    assert "try nodes=2: cannot predict nodes: 2 because the run had one host" in result.stdout


def test_a_many_times_slower_gain_keeps_two_significant_digits():
    """bf16 autocast on a CPU without bf16 units ran 0.031x: two decimals would print it as 0.03, its interval
    as 0.03-0.03, and a 60x slow-down the same."""
    from dtrain.explain.render import ratio

    assert [ratio(v) for v in (0.0312, 0.0168, 0.099, 0.1, 1.234, 10.32)] == [
        "0.031", "0.017", "0.099", "0.10", "1.23", "10.32"]
