"""``profile.json`` as a typed record: the file a run writes loads and writes back byte for byte, and a
file of another schema version or damaged JSON is one line that says what to do."""

from __future__ import annotations

import json

import pytest
from helpers import cli_in_process
from profiles import make_profile, write

from dtrain.errors import UserError
from dtrain.profiling import commprobe
from dtrain.profiling.phases import PHASES
from dtrain.profiling.record import (
    SCHEMA_VERSION,
    PhaseSeconds,
    ProfileError,
    ProfileRecord,
    WorkSeconds,
    load_profile,
    load_run_profile,
    write_profile,
)
from dtrain.profiling.stragglers import WORK_PHASES


def _one_line(exc: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(exc.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    return message


@pytest.mark.slow
@pytest.mark.parametrize("slots", [1, 2])
def test_a_real_profile_round_trips_byte_for_byte(tmp_path, reference_runs, slots):
    original = reference_runs.run_dir(slots) / "profile.json"
    record = load_profile(original)
    assert record.schema_version == SCHEMA_VERSION and record.slots == slots and len(record.per_rank) == slots
    assert (record.stragglers is not None) == (slots > 1)  # measured with 2+ slots only: absent, not null
    copy = tmp_path / "profile.json"
    write_profile(copy, record)
    assert copy.read_text() == original.read_text()
    assert load_profile(copy) == record


@pytest.mark.slow
@pytest.mark.parametrize("slots", [1, 2])
def test_a_real_run_records_what_the_cost_model_needs_and_reproduces_itself(reference_runs, slots):
    from dtrain.explain.costmodel import CostModel

    record = load_profile(reference_runs.run_dir(slots) / "profile.json")
    assert record.solo_probe is not None and {p.threads for p in record.solo_probe.points} >= {1}
    assert all(p.work_seconds > 0 and p.work_double_seconds > 0 for p in record.solo_probe.points)
    # The optimizer's own step, alone at each thread count and on every rank at once (its contention).
    assert all(p.optimizer_seconds > 0 for p in record.solo_probe.points)
    assert record.batch_scaling is not None and record.batch_scaling.optimizer_seconds > 0
    assert record.compression_cost is not None and record.compression_cost.powersgd_bytes > 0
    assert record.step_jitter_seconds is not None and record.step_window_seconds
    # The link is probed among the run's own ranks, at sizes from a few KB to tens of MB.
    assert (record.comm_probe is not None) == (slots > 1)
    if slots > 1:
        sizes = [p.bytes for p in record.comm_probe.points]
        assert min(sizes) <= 4096 and max(sizes) >= 8 * 2**20 and all(p.seconds > 0 for p in record.comm_probe.points)
        # And in fp16, as the 16-bit compressions send it: Gloo sums those at a rate of its own.
        half = record.comm_probe.half_points
        assert [p.bytes for p in half] == list(commprobe.HALF_SIZES) and all(p.seconds > 0 for p in half)
        model = CostModel.from_profile(record)
        assert model.predict(model.measured_target()).step == pytest.approx(record.seconds_per_step.step.mean)


def test_a_built_record_round_trips_and_leaves_unmeasured_sections_out(tmp_path):
    record = make_profile([{"data": 0.001, "forward": 0.002}], optimizer=None, lr_hyperparameter=None)
    path = write(tmp_path, record)
    document = json.loads(path.read_text())
    for absent in ("stragglers", "batch_scaling", "allreduce_probe", "data_load_seconds_per_batch",
                   "data_load_cpu_share", "solo_probe", "comm_probe", "compression_cost", "step_jitter_seconds",
                   "step_window_seconds"):
        assert absent not in document
    assert document["optimizer"] is None and document["lr_hyperparameter"] is None  # null where the run says so
    assert "matmul_tflops" not in document["device_facts"]  # a CUDA fact on a CPU run
    assert list(document)[:2] == ["schema_version", "slots"] and document["schema_version"] == SCHEMA_VERSION
    assert load_profile(path) == record


def test_an_int_hyperparameter_stays_an_int(tmp_path):
    record = make_profile([{"forward": 0.001}], lr_hyperparameter={"name": "lr", "value": 1})
    assert '"value": 1\n' in write(tmp_path, record).read_text()


def test_phase_fields_follow_the_profilers_phases():
    assert tuple(PhaseSeconds.model_fields) == (*PHASES, "step")
    assert tuple(WorkSeconds.model_fields) == WORK_PHASES
    record = make_profile([{"backward": 0.003}])
    assert record.seconds_per_step.of("backward").mean == 0.003
    assert [name for name, _ in record.seconds_per_step.items()] == [*PHASES, "step"]
    with pytest.raises(KeyError):
        record.per_rank[0].seconds_per_step.of("nonsense")


@pytest.mark.parametrize("version", [0, SCHEMA_VERSION + 1, "1"])
def test_another_schema_version_is_one_line_naming_both(tmp_path, version):
    document = make_profile([{"forward": 0.001}]).model_dump()
    document["schema_version"] = version
    (tmp_path / "profile.json").write_text(json.dumps(document))
    with pytest.raises(ProfileError) as exc:
        load_profile(tmp_path / "profile.json")
    _one_line(exc, f"schema_version {version!r}", f"reads schema_version {SCHEMA_VERSION}", "re-run")
    assert issubclass(ProfileError, UserError)


def test_the_doctor_says_so_in_one_line(tmp_path):
    (tmp_path / "config.yaml").write_text("name: x\n")
    document = make_profile([{"forward": 0.001}]).model_dump()
    (tmp_path / "profile.json").write_text(json.dumps({**document, "schema_version": 0}))
    result = cli_in_process("doctor", str(tmp_path))
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.code == 2 and len(lines) == 1, result.stderr
    assert "schema_version 0" in lines[0] and f"schema_version {SCHEMA_VERSION}" in lines[0]


@pytest.mark.parametrize("text, why", [
    ("", "Expecting value"),
    ('{"schema_version": 1, "per_ra', "Unterminated string"),
    ("[1, 2]", "no schema_version"),
    ('{"schema_version": 1, "slots": 2}', "Field required"),
])
def test_damaged_json_is_one_line(tmp_path, text, why):
    (tmp_path / "profile.json").write_text(text)
    with pytest.raises(ProfileError) as exc:
        load_profile(tmp_path / "profile.json")
    _one_line(exc, "is empty or corrupt", why, "re-run the experiment")


def test_a_wrong_type_or_unknown_key_is_damage(tmp_path):
    good = make_profile([{"forward": 0.001}]).model_dump()
    for bad, where in (({**good, "slots": "2"}, "slots"), ({**good, "surprise": 1}, "surprise"),
                       ({**good, "phases": ["forward"]}, "phases")):
        (tmp_path / "profile.json").write_text(json.dumps(bad))
        with pytest.raises(ProfileError) as exc:
            load_profile(tmp_path / "profile.json")
        _one_line(exc, "is empty or corrupt", where)


def test_a_run_directory_without_profiled_steps_is_refused(tmp_path):
    (tmp_path / "config.yaml").write_text("name: x\n")
    write(tmp_path, make_profile([{}]))  # every phase zero: all steps were warm-up
    assert load_profile(tmp_path / "profile.json").seconds_per_step.step.mean == 0  # the file itself loads
    with pytest.raises(ProfileError) as exc:
        load_run_profile(tmp_path)
    _one_line(exc, "no profiled steps")


def test_records_are_read_only():
    record = make_profile([{"forward": 0.001}])
    with pytest.raises(ValueError):
        record.slots = 3
    assert isinstance(record, ProfileRecord)
