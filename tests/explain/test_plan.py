"""``dtrain plan`` and the cost model under it, on scripted profiles; bad input."""

import json
from dataclasses import replace

import pytest
from helpers import cli_in_process, tiny_config
from profiles import make_profile, write

from dtrain.errors import UserError
from dtrain.explain import fitted
from dtrain.explain.costmodel import GROWTH_NOT_PROBED, CostModel, Link, Target, expected_max
from dtrain.explain.facts import Work
from dtrain.explain.plan import parse_link, plan
from dtrain.explain.spread import uncertainties
from dtrain.profiling import commprobe
from dtrain.profiling.commprobe import LocalProbe, fit

# A gloo-like link on one host: 0.3 ms per message, 1 GB/s.
LINK_POINTS = [(float(b), 3e-4 + b / 1e9) for b in commprobe.SIZES]
SOLO = {"per_slot_batch_size": 64, "points": [
    {"threads": 2, "work_seconds": 0.0020, "work_double_seconds": 0.0032},
    {"threads": 1, "work_seconds": 0.0030, "work_double_seconds": 0.0054}]}


def _profile(slots=2, exposed=0.004, threads=1, **overrides):
    phases = {"data": 0.001, "forward": 0.001, "backward": 0.002, "comm_exposed": exposed if slots > 1 else 0.0,
              "optimizer": 0.001, "other": 0.0}
    step = sum(phases.values())
    solo = {**SOLO, "per_slot_batch_size": 64 // slots}
    sections = {
        "samples_per_second": 64 / step, "parameters": 250_000, "threads_per_slot": threads,
        "strategy_compressions": ["none", "fp16", "powersgd"],
        "comm": {"busy_seconds_per_step": exposed, "exposed_seconds_per_step": exposed,
                 "buckets_per_step": 1 if slots > 1 else 0, "latency_seconds": 0.0003,
                 "bytes_per_step": 1e6 if slots > 1 else 0, "algbw_bytes_per_second": 1e9,
                 "busbw_bytes_per_second": 1e9},
        "batch_scaling": {"per_slot_batch_size": 64 // slots, "work_seconds": 0.003, "work_double_seconds": 0.0045,
                          "load_seconds": 0.001, "load_double_seconds": 0.002},
        "solo_probe": solo, "step_jitter_seconds": 0.0002,
        "compression_cost": {"fp16_seconds": 1e-4, "powersgd_seconds": 5e-4, "powersgd_bytes": 2e4,
                             "powersgd_rank": 2},
        "step_window_seconds": [step * f for f in (0.98, 1.0, 1.02, 1.0)],
    }
    if slots > 1:
        sections["comm_probe"] = {"world": slots, "backend": "gloo",
                                  "points": [{"bytes": b, "seconds": s} for b, s in LINK_POINTS]}
    return make_profile([phases] * slots, "h0", slots=slots, **{**sections, **overrides})


def _run_dir(tmp_path, profile):
    (tmp_path / "config.yaml").write_text("name: x\nmax_length:\n  batches: 1000\n")
    write(tmp_path, profile)
    return tmp_path


def test_the_link_fit_recovers_latency_and_rate():
    link = fit(LINK_POINTS)
    assert link.latency == pytest.approx(3e-4, rel=1e-6) and link.rate == pytest.approx(1e9, rel=1e-6)
    assert link.residual == pytest.approx(0.0, abs=1e-9)


def test_work_follows_amdahl_between_probed_thread_counts():
    work = Work.from_pairs(64, {1: (0.004, 0.008), 4: (0.001, 0.002)})
    assert work.seconds(64, 1) == pytest.approx(0.004) and work.seconds(128, 4) == pytest.approx(0.002)
    # s + p / t through (1, 4 ms) and (4, 1 ms): p = 4 ms, s = 0.
    assert work.seconds(64, 2) == pytest.approx(0.002)


def test_a_multi_slot_run_reproduces_itself_and_its_options_move_the_way_they_should():
    model = CostModel.from_profile(_profile())
    mine = model.predict(model.measured_target())
    assert mine.step == pytest.approx(model.facts.step, rel=1e-6)
    assert mine.low < mine.step < mine.high
    base, three = model.predict(Target(2)), model.predict(Target(3))
    assert three.parts["exchange"] > base.parts["exchange"]  # more ring steps, more jitter to wait for
    assert model.predict(Target(2, aggregation=4)).parts["exchange"] == pytest.approx(base.parts["exchange"] / 4)
    fp16 = model.predict(Target(2, compression="fp16"))
    assert fp16.parts["compression"] == pytest.approx(1e-4)  # the measured cast is not free
    # 1 MB of gradients at 1 GB/s: halving the bytes saves 0.5 ms of wire and costs 0.1 ms of casting.
    assert base.parts["exchange"] - fp16.parts["exchange"] == pytest.approx(0.0005 - 0.0001, rel=1e-6)
    # PowerSGD: its measured matmuls and QR, and its hook's own host time for each of its 2 collectives.
    hook = fitted.load().terms["powersgd_hook_seconds"]
    assert model.predict(Target(2, compression="powersgd")).parts["compression"] == pytest.approx(5e-4 + 2 * hook)


def test_a_powersgd_runs_two_all_reduces_a_step_are_one_bucket():
    """PowerSGD sends its P and its Q matrices in two all-reduces per bucket, and the run counts all-reduces. The
    model's gradients fit one bucket at any threshold: a threshold that still makes one bucket changes nothing,
    and dropping compression sends the whole gradients in one message instead of two small ones (a 2-slot run of
    digits with PowerSGD was priced as two buckets of two, and every change from it 1.4x too fast)."""
    powersgd = _profile(gradient_compression="powersgd", gradient_bytes=[[500_000, 500_000]],
                        comm={"busy_seconds_per_step": 0.004, "exposed_seconds_per_step": 0.004,
                              "buckets_per_step": 2, "latency_seconds": 0.0003, "bytes_per_step": 2e4,
                              "algbw_bytes_per_second": 1e9, "busbw_bytes_per_second": 1e9})
    model = CostModel.from_profile(powersgd)
    assert model.facts.buckets == pytest.approx(1.0)
    own = model.predict(model.measured_target())
    assert own.step == pytest.approx(model.facts.step, rel=1e-6)
    assert model.predict(Target(2, bucket_mb=1.0)).step == pytest.approx(own.step, rel=1e-9)
    plain = model.predict(Target(2, compression="none"))
    assert own.step - plain.step == pytest.approx(
        own.parts["compression"] + 2 * model.allreduce(1e4, Target(2)) - model.allreduce(1e6, Target(2)), rel=1e-6)


def test_sixteen_bit_compression_sends_at_the_rate_its_all_reduces_were_measured_at():
    """Gloo sums 16-bit floats element by element on the CPU: half the bytes took as long as all of them. The run's
    ranks timed fp16 all-reduces too, and fp16 and bf16 compression send at that rate (a 2 M-parameter model
    on 2 cores was priced 1.24x with fp16, measured 0.92x); a profile without them keeps fp32's rate."""
    half_points = [{"bytes": b, "seconds": 3e-4 + 2 * b / 1e9} for b in (65536, 2**20, 8 * 2**20)]
    probe = {"world": 2, "backend": "gloo", "points": [{"bytes": b, "seconds": s} for b, s in LINK_POINTS]}
    timed = CostModel.from_profile(_profile(comm_probe={**probe, "half_points": half_points}))
    untimed = CostModel.from_profile(_profile(comm_probe=probe))
    assert timed.predict(Target(2)).step == pytest.approx(untimed.predict(Target(2)).step, rel=1e-9)
    for compression in ("fp16", "bf16"):
        slow, fast = (m.predict(Target(2, compression=compression)) for m in (timed, untimed))
        # 0.5 MB sent at half of fp32's rate costs what 1 MB did: 0.5 ms more than at fp32's.
        assert slow.parts["exchange"] - fast.parts["exchange"] == pytest.approx(0.0005, rel=1e-6)
    assert any(s.name.startswith("fp16 all-reduces") for s in timed.sources)


def test_only_a_loads_cpu_share_slows_down_on_more_slots_than_cores():
    """Four slots on two cores take turns on them: a load that spends its time on the CPU takes twice as long,
    one that mostly waits (a disk, a network, a decoder elsewhere) does not. A 2-slot run whose loader slept 98% of
    each batch was priced 0.81x at 4 slots; it measured 1.41x (each slot loads half the batch)."""
    busy = CostModel.from_profile(_profile(data_load_cpu_share=1.0)).predict(Target(4)).parts["data"]
    waiting = CostModel.from_profile(_profile(data_load_cpu_share=0.02)).predict(Target(4)).parts["data"]
    assert waiting == pytest.approx(busy / 2 * (0.02 * 2 + 0.98), rel=1e-9)
    unknown = CostModel.from_profile(_profile()).predict(Target(4)).parts["data"]
    assert unknown == pytest.approx(busy, rel=1e-9)  # not probed: a load is taken to need a core


def test_on_fewer_local_slots_a_cpu_runs_host_work_sheds_the_slots_contention():
    """Two local slots slowed each other's model steps by 1.5x: without a probe of its own, their optimizer steps
    are taken to have contended as much, so one slot alone does them 1.5x faster (at the same per-slot batch).
    Loading is what the batch makes it (below)."""
    model = replace(CostModel.from_profile(_profile()), contention=1.5)
    own = model.predict(model.measured_target())
    alone = model.predict(Target(1, global_batch=model.facts.per_slot_batch, threads=1))
    assert alone.parts["fixed"] == pytest.approx(own.parts["fixed"] / 1.5)
    assert alone.parts["data"] == pytest.approx(own.parts["data"])


def test_the_optimizer_follows_its_own_probe_of_threads_and_neighbours():
    """The probe timed one optimizer step alone at 1 and 2 threads (0.10, 0.08 ms) and on both ranks at once
    (0.13 ms at the run's 1 thread): one slot with 2 threads does the run's optimizer phase at 0.08 / 0.13 of it,
    whatever the model steps' contention."""
    solo = {**SOLO, "per_slot_batch_size": 32, "points": [
        {**SOLO["points"][0], "optimizer_seconds": 0.8e-4}, {**SOLO["points"][1], "optimizer_seconds": 1e-4}]}
    scaling = {"per_slot_batch_size": 32, "work_seconds": 0.003, "work_double_seconds": 0.0045,
               "load_seconds": 0.001, "load_double_seconds": 0.002, "optimizer_seconds": 1.3e-4}
    model = replace(CostModel.from_profile(_profile(solo_probe=solo, batch_scaling=scaling)), contention=1.5)
    own = model.predict(model.measured_target())
    alone = model.predict(Target(1, global_batch=model.facts.per_slot_batch))
    assert alone.parts["fixed"] == pytest.approx(own.parts["fixed"] * 0.8 / 1.3)
    # Hosts that are namespaces of one machine share its memory: their slots still slow each other.
    apart, together = model.predict(Target(2, 2, cores=1)), model.predict(Target(2, 2, cores=1, machine_slots=2))
    assert together.parts["fixed"] == pytest.approx(own.parts["fixed"])
    assert apart.parts["fixed"] == pytest.approx(own.parts["fixed"] / 1.3)
    assert together.parts["compute"] == pytest.approx(1.5 * apart.parts["compute"])


def test_a_bigger_batch_grows_the_whole_wait_where_the_slots_stay_and_the_probes_load_where_they_leave():
    """The run (2 slots) waited 1 ms per batch for data; the probe's own load of a batch took 0.3 ms, of twice it
    0.5 ms. On the same 2 slots a host, twice the batch waits 1.67 ms: the run's slower loads (between steps,
    beside the other slot) grow with it. On 1 slot, part of that slowdown leaves with the other slot, by a share
    not measured: the wait grows by what the probe's load grew, 1.2 ms."""
    scaling = {"per_slot_batch_size": 32, "work_seconds": 0.003, "work_double_seconds": 0.0045,
               "load_seconds": 0.0003, "load_double_seconds": 0.0005}
    model = CostModel.from_profile(_profile(batch_scaling=scaling))
    assert model.predict(Target(2, global_batch=128, threads=1)).parts["data"] == pytest.approx(0.001 * (1 + 2 / 3))
    assert model.predict(Target(1, global_batch=64, threads=1)).parts["data"] == pytest.approx(0.0012)
    # Two hosts that are namespaces of one machine keep its two slots side by side: the whole wait grows.
    both = model.predict(Target(2, 2, global_batch=128, threads=1, machine_slots=2))
    assert both.parts["data"] == pytest.approx(0.001 * (1 + 2 / 3))
    # Loader processes hide loading (the wait is shorter than the probe's load): the wait grows in proportion.
    hidden = replace(model, facts=replace(model.facts, data=0.0001))
    assert hidden.predict(Target(2, global_batch=128, threads=1)).parts["data"] == pytest.approx(0.0001 * (1 + 2 / 3))
    assert hidden.predict(Target(1, global_batch=64, threads=1)).parts["data"] == pytest.approx(0.0001 * (1 + 2 / 3))


def test_a_slow_link_between_hosts_costs_its_bytes_and_latency():
    model = CostModel.from_profile(_profile(), between_hosts=parse_link("200mbit,1ms"))
    local, hosts = model.predict(Target(2)), model.predict(Target(2, 2, cores=1))
    # 1 MB through 25 MB/s of frames, of which TCP's payload gets its share, instead of 1 GB/s measured, plus 1 ms
    # per ring step (two steps for two ranks).
    extra = 1e6 / (25e6 * fitted.load().terms["tcp_goodput"]) - 1e6 / 1e9 + 2 * 0.001
    assert hosts.parts["exchange"] - local.parts["exchange"] == pytest.approx(extra, rel=0.05)
    # The given link prices the exchange between the hosts: its uncertainty, not the measured link fit's residual.
    noisy = replace(model, link_residual=0.3)
    assert "link fit residual" in uncertainties(noisy, Target(2), noisy._parts(Target(2)), local.step)
    between = uncertainties(noisy, Target(2, 2, cores=1), noisy._parts(Target(2, 2, cores=1)), hosts.step)
    assert "link fit residual" not in between and "link_between_hosts" in between


def test_a_one_slot_run_on_shared_cores_prices_communication_from_a_probe_and_never_beats_linear(tmp_path):
    run = _run_dir(tmp_path, _profile(slots=1, threads=2))
    # The run's host is not this one and no probe is saved: nothing can price the link, so no guess.
    with pytest.raises(UserError, match="no link was measured or given"):
        plan(run, [1, 2], log=lambda line: None)
    probe = LocalProbe(2, 1, LINK_POINTS, [1e6], 0.002, exchange_seconds=0.0003 + 1e6 / 1e9 + 0.0005)
    commprobe.save(probe, run / commprobe.PROBE_FILE)
    doc = plan(run, [1, 2, 4], log=lambda line: None).to_json()
    by = {(p["slots"], p["option"]): p for p in doc["predictions"]}
    one = by[(1, "base")]["samples_per_second"]
    for n in (2, 4):
        assert by[(n, "base")]["samples_per_second"] <= n * one * (1 + 1e-9)
        assert by[(n, "base")]["parts_seconds"]["exchange"] >= 0.0003 + 1e6 / 1e9  # the probed link, at least
    sources = {i["name"]: i["source"] for i in doc["inputs"]}
    assert sources["link among local slots"] == "probed"
    assert "fp16 all-reduces among local slots" not in sources  # a probe file from before it timed them
    half = [(b, 3e-4 + 2 * b / 1e9) for b, _ in LINK_POINTS]
    commprobe.save(replace(probe, half_points=half), run / commprobe.PROBE_FILE)
    doc = plan(run, [1, 2], log=lambda line: None).to_json()
    assert {i["name"]: i["source"] for i in doc["inputs"]}["fp16 all-reduces among local slots"] == "probed"
    assert sources["exchange cost in training beyond the link"] == "probed"
    # Each of 2 slots gets 1 of the 2 cores: the 1-thread probe, not the run's 2 threads, sets its compute.
    two = by[(2, "base")]["parts_seconds"]["compute"]
    factor = 0.003 / 0.0020  # the run's compute over its own 2-thread probe
    per_sample = (0.0054 - 0.0030) / 64  # at 1 thread: 3.0 ms at 64 samples, 5.4 ms at 128
    assert two == pytest.approx((0.0030 - 64 * per_sample + 32 * per_sample) * factor)


def test_intervals_widen_with_what_was_not_measured():
    multi = CostModel.from_profile(_profile())
    single = CostModel.from_profile(_profile(slots=1, threads=2), LINK_POINTS, 2, 0.0005)

    def width(pred):
        return pred.high / pred.low

    assert width(single.predict(Target(2))) > width(multi.predict(Target(2)))
    assert expected_max(2) < expected_max(8) < expected_max(64)


def test_plan_cli_json_leaves_the_chart_alone_and_bad_input_is_one_line(tmp_path):
    run = _run_dir(tmp_path, _profile())
    result = cli_in_process("plan", str(run), "--slots", "1,2,4", "--json")
    assert result.code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert not (run / "plan.png").exists() and doc["png"] is None
    assert {p["slots"] for p in doc["predictions"]} == {1, 2, 4}
    assert all(p["low"] <= p["samples_per_second"] <= p["high"] for p in doc["predictions"])
    text = cli_in_process("plan", str(run), "--slots", "1,2")
    assert text.code == 0 and "80% interval" in text.stdout and "[measured]" in text.stdout
    assert (run / "plan.png").stat().st_size > 1000
    for args, fragment in ((["--link", "fast"], "expected a rate"), (["--nodes", "2"], "needs --link"),
                           (["--link", "200mbit,soon"], "latency")):
        bad = cli_in_process("plan", str(run), *args)
        assert bad.code == 2 and fragment in bad.stderr, bad


def test_time_and_cost_to_finish_count_failures_and_advise_the_checkpoint_period(tmp_path):
    # 1 s per checkpoint every 10 batches of ~8 ms: far too often for a node failing every 10 hours.
    profile = _profile(checkpoint_seconds=1001.0, wall_seconds=2000.0, train_seconds=900.0, validation_seconds=0.0)
    run = _run_dir(tmp_path, profile)
    (run / "config.yaml").write_text("name: x\nmax_length: {batches: 10000000}\nmin_checkpoint_period: {batches: 10}\n")
    (run / "summary.json").write_text(json.dumps({"batches": 10000, "epochs": 10}))
    doc = plan(run, [1, 2], mttf_hours=10.0, price=2.0).to_json()
    assert doc["checkpoint_seconds"] == pytest.approx(1.0, rel=0.01)  # 1001 s over 1000 + 1 checkpoints
    row = next(p for p in doc["predictions"] if p["slots"] == 2 and p["option"] == "base")
    finish = row["finish"]
    assert finish["configured"]["seconds"] > 1e7 * row["seconds_per_step"] + 999_000  # 1e6 checkpoints at least
    assert finish["advice"]["key"] == "min_checkpoint_period" and finish["advice"]["value"]["batches"] > 10
    assert finish["configured"]["cost"] == pytest.approx(finish["configured"]["seconds"] / 3600 * 2 * 2.0)
    from dtrain.explain.doctor import add_checkpoint_advice, diagnose

    diagnosis = diagnose(profile)
    add_checkpoint_advice(diagnosis, finish)
    assert any(r.key == "min_checkpoint_period" for r in diagnosis.recommendations)
    bad = cli_in_process("plan", str(run), "--mttf", "soon")
    assert bad.code == 2 and "mttf" in bad.stderr.lower()


def test_a_run_whose_phases_were_not_seen_is_not_planned_or_verified(tmp_path):
    # A trial calling loss.backward() / opt.step() itself: compute would be priced at zero.
    run = _run_dir(tmp_path, _profile(unobserved_phases=["forward", "backward", "comm_exposed", "optimizer"]))
    for args in (["plan", str(run)], ["doctor", str(run), "--verify"]):
        result = cli_in_process(*args)
        assert result.code == 2 and "the step's phases were not observed" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_a_link_carries_a_shapers_burst_and_refuses_anything_else():
    assert parse_link("200mbit,50us,4000b") == Link(25e6, pytest.approx(50e-6), "200mbit,50us,4000b", 4000.0)
    assert parse_link("1gbit,4kb").burst_bytes == 4096.0 and parse_link("1gbit,4kb").latency_seconds == 0.0
    assert parse_link("1gbit,0.2ms").burst_bytes is None
    for text in ("200mbit,1ms,2ms", "200mbit,4000b,4000b", "200mbit,0b", "200mbit,1ms,4000b,x"):
        with pytest.raises(UserError, match="at most a latency"):
            parse_link(text)


def test_a_given_link_replaces_the_one_a_multi_host_run_measured(tmp_path):
    """A run across two hosts measured its ring through their link; ``--link`` replaces it (faster or slower),
    says so among the inputs, and the gains stay over the run as it ran."""
    phases = {"data": 0.001, "forward": 0.001, "backward": 0.002, "comm_exposed": 0.05, "optimizer": 0.001}
    points = [{"bytes": b, "seconds": 4e-4 + b / 25e6} for b in commprobe.SIZES]  # 200 Mbit between the hosts
    profile = make_profile([phases, phases], ["a", "b"], parameters=250_000, samples_per_second=64 / 0.055,
                           strategy_compressions=["none", "fp16"], step_jitter_seconds=0.0002,
                           comm={"busy_seconds_per_step": 0.05, "exposed_seconds_per_step": 0.05,
                                 "buckets_per_step": 1, "bytes_per_step": 1e6, "latency_seconds": 4e-4,
                                 "algbw_bytes_per_second": 2e7},
                           comm_probe={"world": 2, "backend": "gloo", "points": points})
    measured = CostModel.from_profile(profile).predict(Target(2, 2)).step
    fast = CostModel.from_profile(profile, between_hosts=parse_link("10gbit")).predict(Target(2, 2)).step
    slow = CostModel.from_profile(profile, between_hosts=parse_link("50mbit")).predict(Target(2, 2)).step
    assert fast < 0.5 * measured < measured < slow
    run = _run_dir(tmp_path, profile)
    doc = plan(run, [2], nodes=2, link=parse_link("10gbit"))
    assert any("replaces the link measured" in i.value for i in doc.inputs)
    row = next(r for r in doc.predictions if r.option == "base" and r.nodes == 2)
    assert row.gain > 2  # over the run as it ran on its 200 Mbit, not over the run re-priced on 10 Gbit
    from dtrain.explain.predictor import Predictor
    from dtrain.explain.trying import predict_all

    (tried,) = predict_all(run, profile, Predictor(profile), ["nodes=2"], "10gbit")
    assert tried.gain == pytest.approx(row.gain) and "10gbit (replaces" in tried.inputs["link between hosts"]


def test_hosts_priced_on_a_one_host_runs_link_say_it_is_loopback(tmp_path):
    """``--link measured`` from a run on one host prices the hosts' link as the host's own loopback: the plan
    and the doctor's ``--try nodes`` say so, and how to give a network instead; a given rate does not."""
    from dtrain.explain.predictor import Predictor
    from dtrain.explain.trying import predict_all

    profile = _profile(slots=2)
    run = _run_dir(tmp_path, profile)
    assumed = [i for i in plan(run, [2], nodes=2, link=parse_link("measured")).inputs
               if i.name == "link between hosts"]
    assert [i.source for i in assumed] == ["assumed"] and "loopback" in assumed[0].value
    assert "--link RATE,LATENCY" in assumed[0].value
    assert not any("loopback" in i.value for i in plan(run, [2], nodes=2, link=parse_link("1gbit")).inputs)
    (tried,) = predict_all(run, profile, Predictor(profile), ["nodes=2"], "measured")
    assert "loopback" in tried.inputs["link between hosts"]


def test_a_precision_row_names_the_per_slot_batch_its_gain_was_timed_at():
    """Another per-slot batch or thread count may gain otherwise (bf16 without bf16 units: 0.115x at 32
    samples on one thread, 0.079x at 64 on two): the row says where its figure comes from."""
    from dtrain.explain.plan import Case

    case = Case(Target(2, precision_gain=0.0789), "precision", "bf16-mixed", 64)
    assert case.label == "precision: bf16-mixed (compute 0.079x, measured at 64 samples per slot)"


def test_a_model_not_timed_at_twice_its_batch_spans_all_to_none_of_its_work_growing_with_it(tmp_path):
    """No batch probe (a trial stepping its own optimizer, a model that cannot take twice its batch): at one
    slot, 3 ms of compute and 1 ms of loading per 64 samples, 1 ms fixed. At 128 samples all of it growing gives
    9 ms, none 5 ms: the point is halfway, the interval spans both, and the doctor's --try says why."""
    blind = _profile(slots=1, batch_scaling=None, solo_probe=None, data_load_seconds_per_batch=None)
    model = CostModel.from_profile(blind)
    assert model.facts.batch_growth_probed is False
    double = model.predict(Target(1, global_batch=128, threads=1))
    assert double.step == pytest.approx(0.007, rel=0.02)
    assert double.low < 0.005 * 1.01 and double.high > 0.009 * 0.99
    assert double.widest == GROWTH_NOT_PROBED
    # At the run's own per-slot batch nothing is extrapolated: the usual interval, as when probed.
    same = model.predict(Target(1, global_batch=64, threads=1))
    assert same.step == pytest.approx(0.005, rel=0.02) and same.widest != GROWTH_NOT_PROBED
    probed = CostModel.from_profile(_profile(slots=1)).predict(Target(1, global_batch=128, threads=1))
    assert probed.widest != GROWTH_NOT_PROBED and probed.high / probed.low < double.high / double.low
    run = _run_dir(tmp_path, blind)
    (tmp_path / "trial").mkdir()
    (run / "config.yaml").write_text(tiny_config(tmp_path / "trial").read_text())  # --try checks its changes there
    result = cli_in_process("doctor", str(run), "--json", "--try", "hyperparameters.global_batch_size=128",
                            "--try", "optimizations.aggregation_frequency=2")
    assert result.code == 0, result.stderr
    tries = {t["try"]: t for t in json.loads(result.stdout)["tries"]}
    bigger = tries["hyperparameters.global_batch_size=128"]
    assert "not timed at twice its batch" in bigger["reason"] and bigger["low"] < bigger["high"]
    # Its interval is wider than +/-25%: no point figure, and --verify named as what measures it (issue 73).
    assert bigger["gain"] is None and bigger["samples_per_second"] is None
    assert "to within +/-25%" in bigger["reason"] and "--verify" in bigger["reason"]
    assert bigger["low"] <= 128 / 0.009 / blind.samples_per_second * 1.01
    assert bigger["high"] >= 128 / 0.005 / blind.samples_per_second * 0.99
    assert "not timed" not in (tries["optimizations.aggregation_frequency=2"]["reason"] or "")


def test_n_slots_are_called_slower_than_one_only_where_the_whole_range_of_an_unprobed_growth_says_so():
    from dtrain.explain.doctor import diagnose

    unsure = diagnose(_profile(slots=2, exposed=0.004, batch_scaling=None, solo_probe=None)).scaling
    assert unsure.estimated_speedup_vs_one_slot < 1 < unsure.estimated_speedup_vs_one_slot_interval[1]
    assert not unsure.slower_than_one_slot
    assert diagnose(_profile(slots=2, exposed=0.004)).scaling.slower_than_one_slot  # probed: the point says it
    assert diagnose(_profile(slots=2, exposed=0.02, batch_scaling=None, solo_probe=None)).scaling.slower_than_one_slot
