"""``dtrain plan``: the model on a scripted profile, and bad input."""

import json

import pytest
from helpers import cli_in_process
from profiles import make_profile, write

from dtrain.explain.plan import Case, Measured, parse_link, plan, predict_step


def _run_dir(tmp_path, slots=2, exposed=0.004, buckets=1):
    phases = {"data": 0.001, "forward": 0.002, "backward": 0.003, "comm_exposed": exposed, "optimizer": 0.001,
              "other": 0.0}
    step = sum(phases.values())
    profile = make_profile(
        [phases] * slots, "h0", slots=slots, samples_per_second=64 / step, global_batch_size=64, parameters=250_000,
        strategy_compressions=["none", "fp16"],
        comm={"busy_seconds_per_step": exposed, "exposed_seconds_per_step": exposed, "buckets_per_step": buckets,
              "latency_seconds": 0.0005, "bytes_per_step": 1e6, "algbw_bytes_per_second": 1e9,
              "busbw_bytes_per_second": 1e9},
        batch_scaling={"per_slot_batch_size": 64 // slots, "work_seconds": 0.005, "work_double_seconds": 0.0075,
                       "load_seconds": 0.001, "load_double_seconds": 0.002},
        allreduce_probe={"bytes": 1e6, "seconds": 0.0015})
    (tmp_path / "config.yaml").write_text("name: x\nmax_length:\n  batches: 1000\n")
    write(tmp_path, profile)
    return tmp_path


def test_the_measured_configuration_reproduces_itself_and_options_help(tmp_path):
    doc = plan(_run_dir(tmp_path), [1, 2, 4], nodes=2, link=parse_link("200mbit"))
    assert doc["measured"]["model_samples_per_second"] == pytest.approx(doc["measured"]["samples_per_second"])
    by = {(p["slots"], p["nodes"], p["option"]): p for p in doc["predictions"]}
    assert by[(2, 1, "base")]["samples_per_second"] == pytest.approx(doc["measured"]["samples_per_second"])
    assert by[(1, 1, "base")]["efficiency"] == pytest.approx(1.0)
    assert by[(2, 1, "aggregation")]["samples_per_second"] > by[(2, 1, "base")]["samples_per_second"]
    assert by[(2, 2, "compression")]["samples_per_second"] > by[(2, 2, "base")]["samples_per_second"]
    # 1 MB of gradients over 25 MB/s: the 200 Mbit link makes 2 hosts slower than 2 slots of one host.
    assert by[(2, 2, "base")]["seconds_per_step"] > by[(2, 1, "base")]["seconds_per_step"] + 0.03
    assert by[(4, 2, "base")]["seconds_to_finish"] == pytest.approx(1000 * by[(4, 2, "base")]["seconds_per_step"])


def test_ring_bytes_and_bucket_overlap(tmp_path):
    m = Measured.from_run(_run_dir(tmp_path, exposed=0.0, buckets=4))
    link = parse_link("200mbit,1ms")
    parts = predict_step(m, Case(2, 2), link)
    ring = 2 * (2 - 1) / 2 * 1e6 / 25e6 + 2 * 0.001  # 2(N-1)/N x bytes / rate, plus latency per ring step
    # Four buckets: all but the last overlap with the 3 ms of backward (scaled to 2 slots' per-slot batch).
    assert parts["communication"] == pytest.approx(max(ring / 4, ring - 0.003), rel=1e-6)


def test_plan_cli_and_bad_input(tmp_path):
    run = _run_dir(tmp_path)
    result = cli_in_process("plan", str(run), "--slots", "1,2,4", "--json")
    assert result.code == 0, result.stderr
    assert (run / "plan.png").stat().st_size > 1000
    assert {p["slots"] for p in json.loads(result.stdout)["predictions"]} == {1, 2, 4}
    for args, fragment in ((["--link", "fast"], "expected a rate"), (["--nodes", "2"], "needs --link"),
                           (["--link", "200mbit,soon"], "latency")):
        bad = cli_in_process("plan", str(run), *args)
        assert bad.code == 2 and fragment in bad.stderr, bad
