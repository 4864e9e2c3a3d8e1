"""``dtrain plan --what-if``: the cost model on paper; every input given, bad specs one line."""

import json

import pytest
from helpers import cli_in_process

from dtrain.errors import UserError
from dtrain.explain import fitted
from dtrain.explain.costmodel import expected_max
from dtrain.explain.paper import parse, plan_on_paper

BERT = "params=330M,compute=441ms@256,gpus-per-node=8,intra=2400gbit:2us,inter=1600gbit:5us,global=65536"


def _without_stragglers():
    values = fitted.load()
    return fitted.trying(fitted.Fitted(values.uncertainty, {**values.terms, "paper_jitter": 0.0}))


def test_strong_scaling_on_paper_is_compute_plus_a_ring_through_the_slower_link():
    with _without_stragglers():
        doc = plan_on_paper(BERT + ",grad-bytes=2,overlap=no", [1, 8, 16])
    by = {p["slots"]: p for p in doc["predictions"]}
    assert by[1]["parts_seconds"]["exchange"] == 0.0
    assert by[1]["seconds_per_step"] == pytest.approx(0.441 * 65536 / 256)
    # 16 GPUs on 2 nodes: 27 buckets of the 0.66 GB of fp16 gradients. A ring: each bucket 2(N-1) steps at
    # both links' latency and 2(N-1)/N of its bytes at 200 GB/s. NCCL's tree: 2(8-1) steps within a node,
    # 2 log2(2) across, at 0.92 of the ring's bandwidth; NCCL runs the faster, here the tree.
    nbytes, n = 2 * 330e6, 16
    buckets = 1 + -(-(nbytes - 2**20) // (25 * 2**20))
    wire = 2 * (n - 1) / n * nbytes / 200e9
    ring = 2 * (n - 1) * buckets * (2e-6 + 5e-6) + wire
    tree = buckets * (2 * 7 * 2e-6 + 2 * 1 * (2e-6 + 5e-6)) + wire / 0.92
    assert tree < ring
    assert by[16]["parts_seconds"]["exchange"] == pytest.approx(tree, rel=1e-6)
    # On one node there is no tree: the ring's 2(N-1) steps at the node link's latency and rate (300 GB/s).
    assert by[8]["parts_seconds"]["exchange"] == pytest.approx(2 * 7 * buckets * 2e-6 + 2 * 7 / 8 * nbytes / 300e9,
                                                                rel=1e-6)
    assert by[16]["efficiency"] < by[8]["efficiency"] <= 1.0
    assert all(p["low"] < p["samples_per_second"] < p["high"] for p in doc["predictions"])
    # Nothing on paper was measured: inputs are given, assumed, or fitted to published results.
    assert {i["source"] for i in doc["inputs"]} <= {"given", "assumed", "fitted"}


def test_each_step_waits_for_the_slowest_of_n_gpus_with_the_fitted_spread():
    spec = BERT + ",grad-bytes=2,overlap=no"
    with _without_stragglers():
        bare = {p["slots"]: p for p in plan_on_paper(spec, [16, 256])["predictions"]}
    spread = fitted.load().terms["paper_jitter"]
    assert spread > 0  # fitted to the published rows (bench/data/plan_rows.json)
    doc = {p["slots"]: p for p in plan_on_paper(spec, [16, 256])["predictions"]}
    for n in (16, 256):
        compute = doc[n]["parts_seconds"]["compute"]
        waited = doc[n]["parts_seconds"]["exchange"] - bare[n]["parts_seconds"]["exchange"]
        assert waited == pytest.approx(spread * compute * expected_max(n), rel=1e-6)


def test_weak_scaling_overlaps_the_exchange_with_backward():
    doc = plan_on_paper("params=25.6M,compute=180ms@32,gpus-per-node=8,intra=160gbit:2us,inter=50gbit:10us", [8, 256])
    by = {p["slots"]: p for p in doc["predictions"]}
    assert doc["scaling"] == "weak" and by[256]["parts_seconds"]["compute"] == pytest.approx(0.180)
    assert by[256]["parts_seconds"]["exchange"] < 0.120  # hidden behind backward but for the last bucket


@pytest.mark.parametrize(("spec", "fragment"), [
    ("params=330M", "needs compute"),
    (BERT + ",speed=3", "not KEY=VALUE"),
    (BERT.replace("441ms@256", "441ms"), "give the batch"),
    (BERT.replace("1600gbit:5us", "fast"), "RATE[:LATENCY]"),
    (BERT + ",overlap=maybe", "yes or no"),
    (BERT.replace("330M", "-3"), "positive"),
])
def test_bad_specs_are_one_line(spec, fragment):
    with pytest.raises(UserError, match=fragment.replace("[", r"\[")):
        parse(spec)


def test_what_if_cli_json_and_its_refusals(tmp_path):
    result = cli_in_process("plan", "--what-if", BERT, "--slots", "8,1024", "--json")
    assert result.code == 0, result.stderr
    assert [p["slots"] for p in json.loads(result.stdout)["predictions"]] == [8, 1024]
    text = cli_in_process("plan", "--what-if", BERT, "--slots", "8,1024", "--png", str(tmp_path / "c.png"))
    assert text.code == 0 and "every input given, assumed or fitted" in text.stdout
    widest = [p["widest_input"].split(" (")[0] for p in json.loads(result.stdout)["predictions"]]
    rows = [line for line in text.stdout.splitlines() if "strong scaling" in line and "│" in line]
    assert "widest input" in text.stdout and len(rows) == 2 and all(w in r for w, r in zip(widest, rows, strict=True))
    too_many = cli_in_process("plan", "--what-if", BERT, "--slots", "2048")
    assert too_many.code == 2 and "at most 1024" in too_many.stderr
    both = cli_in_process("plan", str(tmp_path), "--what-if", BERT)
    assert both.code == 2 and "without a run directory" in both.stderr
    neither = cli_in_process("plan")
    assert neither.code == 2 and "needs a run directory" in neither.stderr
