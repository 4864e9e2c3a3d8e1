"""The cost model's terms (explain/terms/): a step is their sum, the doctor's table is them at the run, a term
plugs in with one new file (this one registers one), and ``--explain`` / ``--json`` show each with its inputs."""

import json

import pytest
from helpers import cli_in_process
from profiles import make_profile, write

from dtrain.explain.costmodel import CostModel, Target
from dtrain.explain.doctor import diagnose
from dtrain.explain.terms import registry
from dtrain.explain.terms.base import MEASURED, At, Input, Term
from dtrain.profiling import commprobe

LINK_POINTS = [(float(b), 3e-4 + b / 1e9) for b in commprobe.SIZES]
SOURCES = {"measured", "probed", "given", "assumed", "fitted"}
BUILTIN = ("compute", "data", "fixed", "exchange", "late_rank")


def _profile(slots=2, datas=None, cores=2, device="cpu", **overrides):
    """A run on one host whose ranks wait ``datas[i]`` for their batch, with its probes (a link among its ranks)."""
    datas = datas or [0.001] * slots
    ranks = [{"data": d, "forward": 0.001, "backward": 0.002, "comm_exposed": 0.004 if slots > 1 else 0.0,
              "optimizer": 0.001} for d in datas]
    step = sum(ranks[0].values())
    sections = {
        "samples_per_second": 64 / step, "parameters": 250_000, "threads_per_slot": 1, "cpu_cores": cores,
        "device": device,
        "comm": {"busy_seconds_per_step": 0.004, "exposed_seconds_per_step": 0.004,
                 "buckets_per_step": 1 if slots > 1 else 0, "latency_seconds": 0.0003,
                 "bytes_per_step": 1e6 if slots > 1 else 0, "algbw_bytes_per_second": 1e9,
                 "busbw_bytes_per_second": 1e9},
        "batch_scaling": {"per_slot_batch_size": 64 // slots, "work_seconds": 0.003, "work_double_seconds": 0.0045,
                          "load_seconds": 0.001, "load_double_seconds": 0.002},
        "step_jitter_seconds": 0.0002, "step_window_seconds": [step * f for f in (0.98, 1.0, 1.02, 1.0)],
    }
    if slots > 1:
        sections["comm_probe"] = {"world": slots, "backend": "gloo",
                                  "points": [{"bytes": b, "seconds": s} for b, s in LINK_POINTS]}
    return make_profile(ranks, "h0", slots=slots, **{**sections, **overrides})


class Checkpointing(Term):
    """A test's term: 0.5 ms a step on every slot count, an input given."""

    name = "toy_checkpointing"

    def seconds(self, at: At) -> float:
        return 0.0005

    def inputs(self, at: At) -> list[Input]:
        return [Input("toy write per step", "0.5 ms", "given")]


@pytest.fixture
def toy():
    registry.register(Checkpointing)
    yield
    registry.unregister(Checkpointing.name)


@pytest.mark.parametrize("slots, datas", [(1, None), (2, None), (2, [0.001, 0.004]), (4, [0.002, 0.001, 0.001,
                                                                                          0.003])])
def test_the_runs_terms_add_up_to_the_step_the_factor_table_shows(slots, datas):
    profile = _profile(slots, datas)
    model = CostModel.from_profile(profile)
    terms = model.explain(model.measured_target())
    assert [t.name for t in terms][:5] == list(BUILTIN)
    diagnosis = diagnose(profile)
    assert sum(t.run_seconds for t in terms) == pytest.approx(diagnosis.step_seconds, rel=1e-9)
    assert sum(f.seconds_per_step for f in diagnosis.factors) == pytest.approx(diagnosis.step_seconds, rel=1e-9)
    # One split of the data wait: the table's row is the model's data term at the run (the mean over ranks).
    data = next(t for t in terms if t.name == "data")
    assert diagnosis.factor("data_loading").seconds_per_step == pytest.approx(data.run_seconds)
    assert data.run_seconds == pytest.approx(sum(datas or [0.001]) / len(datas or [0.001]))
    # compute, precision and batch_size split the compute and fixed terms; the exchange's rows and the straggler
    # are what the exchange and late_rank terms hold (one split: shares and predictions agree).
    rows = {f.factor: f.seconds_per_step for f in diagnosis.factors}
    run = {t.name: t.run_seconds for t in terms}
    assert rows["compute"] + rows["precision"] + rows["batch_size"] == pytest.approx(run["compute"] + run["fixed"])
    assert rows["communication"] + rows["sync_frequency"] + rows["straggler"] == pytest.approx(
        run["exchange"] + run["late_rank"], abs=1e-12)
    for term in terms:
        assert term.run_seconds == term.target_seconds and term.sd_seconds >= 0
        assert all(i.source in SOURCES for i in term.inputs), term


def test_a_term_added_in_its_own_file_is_in_the_step_the_table_and_explain(toy, tmp_path):
    profile = _profile(2)
    model = CostModel.from_profile(profile)
    assert registry.names() == (*BUILTIN, "toy_checkpointing")
    here, four = model.measured_target(), Target(4)
    # The run still reproduces its own step (the calibrated exchange holds less); other targets pay the term.
    assert model.predict(here).step == pytest.approx(model.facts.step, rel=1e-9)
    assert model.predict(four).parts["toy_checkpointing"] == 0.0005
    rows = {t.name: t for t in model.explain(four)}
    assert rows["toy_checkpointing"].target_seconds == 0.0005
    assert rows["toy_checkpointing"].inputs == (Input("toy write per step", "0.5 ms", "given"),)
    assert sum(t.target_seconds for t in rows.values()) == pytest.approx(model.predict(four).step, rel=1e-9)
    # The doctor's table: a row of its own, out of the straggler's remainder; the rows still add up to the step.
    diagnosis = diagnose(profile)
    row = diagnosis.factor("toy_checkpointing")
    assert row is not None and row.seconds_per_step == pytest.approx(0.0005)
    assert sum(f.share for f in diagnosis.factors) == pytest.approx(1.0)
    # --json's plan rows and --explain's text.
    write(tmp_path, profile)
    (tmp_path / "config.yaml").write_text("name: x\nmax_length:\n  batches: 1000\n")
    result = cli_in_process("plan", str(tmp_path), "--slots", "2,4", "--json")
    assert result.code == 0, result.stderr
    for prediction in json.loads(result.stdout)["predictions"]:
        names = [t["name"] for t in prediction["terms"]]
        assert names[:6] == [*BUILTIN, "toy_checkpointing"], names
    text = cli_in_process("plan", str(tmp_path), "--slots", "2,4", "--explain").stdout
    assert "toy_checkpointing: 0.500 ms at the run" in text and "toy write per step: 0.5 ms [given]" in text
    doctor = cli_in_process("doctor", str(tmp_path), "--explain")
    assert doctor.code == 0, doctor.stderr
    assert "toy_checkpointing" in doctor.stdout and "[given]" in doctor.stdout


def test_explain_names_every_term_and_each_input_with_its_source(tmp_path):
    profile = _profile(2)
    write(tmp_path, profile)
    (tmp_path / "config.yaml").write_text("name: x\nmax_length:\n  batches: 1000\n")
    result = cli_in_process("doctor", str(tmp_path), "--explain")
    assert result.code == 0, result.stderr
    explained = result.stdout.split("explained:", 1)[1]
    for name in BUILTIN:
        assert f"  {name}: " in explained, name
    assert f"[{MEASURED}]" in explained and "[probed]" in explained
    step = f"{1e3 * diagnose(profile).step_seconds:.3f} ms at the run"
    assert f"step (the terms added up): {step}" in explained


def test_a_crowded_hosts_effects_are_one_optional_set():
    crowded = CostModel.from_profile(_profile(2, cores=1))  # 2 slots of 1 thread on one core
    bare = CostModel.from_profile(_profile(2, cores=1))
    bare.shared_host = False
    assert crowded.predict(Target(4, cores=1)).step > bare.predict(Target(4, cores=1)).step
    gpu = CostModel.from_profile(_profile(2, device="cuda"))
    off = CostModel.from_profile(_profile(2, device="cuda"))
    off.shared_host = False
    for target in (Target(1), Target(4), Target(2, aggregation=4)):
        assert gpu.predict(target).step == off.predict(target).step


def test_on_paper_each_row_explains_itself_and_nothing_reads_as_measured():
    spec = "params=330M,compute=441ms@256,gpus-per-node=8,intra=2400gbit:2us,inter=1600gbit:5us"
    result = cli_in_process("plan", "--what-if", spec, "--slots", "1,64", "--json")
    assert result.code == 0, result.stderr
    for row in json.loads(result.stdout)["predictions"]:
        assert sum(t["target_seconds"] for t in row["terms"]) == pytest.approx(row["seconds_per_step"], rel=1e-9)
        assert {i["source"] for t in row["terms"] for i in t["inputs"]} <= {"given", "assumed", "fitted"}


def test_a_change_the_model_cannot_price_within_25_percent_is_given_as_its_interval_and_verify():
    """More loader processes than the run timed: only their hand-over is probed (an assumed uncertainty of half
    the step), so the doctor prints the interval without a point and points to --verify."""
    from dtrain.explain.doctor import render

    seconds = {"data": 0.0187, "forward": 0.001, "backward": 0.0006, "comm_exposed": 0.0021, "optimizer": 0.0004}
    profile = make_profile([seconds, seconds], threads_per_slot=1, cpu_cores=2, data_loader_workers=0,
                           data_load_seconds_per_batch=0.0179, data_load_cpu_share=0.06)
    diagnosis = diagnose(profile)
    row = diagnosis.factor("data_loading")
    low, high = row.predicted_interval
    assert row.key == "data_loader.num_workers" and high > 1.25 * row.predicted_speedup
    text = render(diagnosis)
    assert f"{low:.2f}-{high:.2f}x samples/s, wider than +/-25%: dtrain doctor --verify measures it" in text
    assert "wide: --verify" in text and f"predicted about {row.predicted_speedup:.1f}x" not in text
