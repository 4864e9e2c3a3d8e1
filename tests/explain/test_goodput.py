"""Goodput model: Young/Daly optima, Daly's expected time, the configured-vs-optimal comparison and CLI values."""

import math

import pytest

from dtrain.errors import UserError
from dtrain.explain.goodput import (
    GoodputInputs,
    compare,
    daly_period_seconds,
    expected_seconds,
    optimal_period_batches,
    outcome,
    parse_mttf_hours,
    parse_price,
    period_batches,
    system_mttf_hours,
    young_period_seconds,
)

HOUR = 3600.0


def _inputs(**over):
    base = {"step_seconds": 0.5, "total_batches": 200_000, "checkpoint_seconds": 30.0, "restart_seconds": 120.0,
            "nodes": 16, "slots": 128, "mttf_hours": 1000.0, "price_per_slot_hour": 2.0,
            "checkpoint_period_batches": 100}
    return GoodputInputs(**{**base, **over})


def test_system_mttf_divides_by_nodes():
    assert system_mttf_hours(1000.0, 1) == 1000.0
    assert system_mttf_hours(1000.0, 8) == 125.0
    assert _inputs(nodes=4, slots=32).system_mttf_seconds == pytest.approx(250 * HOUR)


def test_young_and_daly_agree_when_checkpoint_is_cheap():
    delta, m = 10.0, 1000 * HOUR
    young, daly = young_period_seconds(delta, m), daly_period_seconds(delta, m)
    assert young == pytest.approx(math.sqrt(2 * delta * m))
    assert daly == pytest.approx(young, rel=0.01)
    # With an expensive checkpoint they part: Daly subtracts delta and adds higher-order terms.
    assert abs(daly_period_seconds(600.0, HOUR) - young_period_seconds(600.0, HOUR)) > 60


def test_daly_caps_at_mttf_when_checkpoint_outlasts_two_mttf():
    assert daly_period_seconds(3 * HOUR, HOUR) == HOUR
    assert daly_period_seconds(2 * HOUR, HOUR) == HOUR


@pytest.mark.parametrize(("delta", "m"), [(10.0, 50 * HOUR), (60.0, 5 * HOUR), (300.0, 2 * HOUR)])
def test_daly_optimum_minimizes_expected_time(delta, m):
    w, r = 1000 * HOUR, 120.0
    tau = daly_period_seconds(delta, m)
    best = expected_seconds(w, tau, delta, r, m)
    for factor in (0.8, 1.2):
        assert expected_seconds(w, tau * factor, delta, r, m) > best


def test_optimal_period_in_batches_beats_neighbours():
    inputs = _inputs()
    n = optimal_period_batches(inputs)
    assert n is not None
    best = outcome(inputs, n).seconds
    assert outcome(inputs, round(0.8 * n)).seconds > best
    assert outcome(inputs, round(1.2 * n)).seconds > best
    assert outcome(inputs, n - 1).seconds >= best
    assert outcome(inputs, n + 1).seconds >= best


def test_no_failures_is_work_plus_checkpoints():
    w, tau, delta = 10_000.0, 1_000.0, 7.0
    assert expected_seconds(w, tau, delta, 120.0, None) == pytest.approx(w + 10 * delta)
    # A huge MTTF converges to the same (expm1 keeps the precision).
    assert expected_seconds(w, tau, delta, 120.0, 1e15) == pytest.approx(w + 10 * delta, rel=1e-9)
    result = outcome(_inputs(mttf_hours=None, checkpoint_period_batches=1000), 1000)
    assert result.seconds == pytest.approx(0.5 * 200_000 + 200 * 30.0)
    assert result.failures == 0.0


def test_no_periodic_checkpoint_restarts_from_the_start():
    inputs = _inputs(total_batches=1000, checkpoint_period_batches=None)
    w, m = inputs.work_seconds, inputs.system_mttf_seconds
    expected = m * math.exp(120.0 / m) * math.expm1((w + 30.0) / m)
    assert outcome(inputs, None).seconds == pytest.approx(expected)
    # A period longer than the run is the same as none.
    assert outcome(inputs, 10**9).seconds == pytest.approx(expected)


def test_failures_and_cost_follow_expected_time():
    inputs = _inputs()
    result = outcome(inputs, 100)
    assert result.failures == pytest.approx(result.seconds / inputs.system_mttf_seconds)
    assert result.cost == pytest.approx(result.seconds / HOUR * 128 * 2.0)
    assert result.goodput == pytest.approx(inputs.work_seconds / result.seconds)
    assert 0 < result.goodput < 1
    assert outcome(_inputs(price_per_slot_hour=None), 100).cost is None


def test_more_nodes_shorter_mttf_shorter_period():
    few = _inputs(nodes=2, slots=16)
    many = _inputs(nodes=64, slots=512)
    assert many.system_mttf_seconds < few.system_mttf_seconds
    assert optimal_period_batches(many) < optimal_period_batches(few)
    assert compare(many).daly_period_batches < compare(few).daly_period_batches


def test_period_batches_rounds_to_at_least_one():
    assert period_batches(0.01, 1.0) == 1
    assert period_batches(10.4, 1.0) == 10
    assert period_batches(10.6, 1.0) == 11


def test_advice_when_checkpointing_far_too_often():
    inputs = _inputs(checkpoint_period_batches=10)
    result = compare(inputs)
    advice = result.advice
    assert advice is not None
    assert advice["key"] == "min_checkpoint_period"
    assert advice["value"] == {"batches": result.optimal.period_batches}
    assert advice["action"] == f"min_checkpoint_period: {{batches: {result.optimal.period_batches}}}"
    assert advice["predicted_time_saving_seconds"] == pytest.approx(result.configured.seconds - result.optimal.seconds)
    assert advice["predicted_time_saving_fraction"] >= 0.02
    assert advice["predicted_cost_saving"] == pytest.approx(result.configured.cost - result.optimal.cost)
    assert advice["predicted_speedup"] > 1
    assert "spends more time on checkpoints" in advice["why"]
    assert "\n" not in advice["why"]
    assert result.to_dict()["advice"] == advice


def test_advice_when_checkpointing_only_at_the_end():
    advice = compare(_inputs(checkpoint_period_batches=None)).advice
    assert advice is not None
    assert "throws away all the work" in advice["why"]


def test_advice_none_when_saving_is_tiny():
    inputs = _inputs()
    n = optimal_period_batches(inputs)
    near = compare(_inputs(checkpoint_period_batches=n + 1))
    assert near.advice is None
    assert near.optimal.seconds <= near.configured.seconds
    assert compare(_inputs(checkpoint_period_batches=n)).advice is None


def test_no_failure_rate_gives_no_optimum_and_no_advice():
    result = compare(_inputs(mttf_hours=None, checkpoint_period_batches=1))
    assert result.optimal is None
    assert result.advice is None
    assert result.configured.seconds == pytest.approx(0.5 * 200_000 + 200_000 * 30.0)


def test_short_run_optimum_is_only_the_final_checkpoint():
    # Failures so rare that one final checkpoint is best: the advice is null, not a period past the end.
    inputs = _inputs(total_batches=100, mttf_hours=1e6, checkpoint_period_batches=1)
    assert optimal_period_batches(inputs) is None
    advice = compare(inputs).advice
    assert advice is not None
    assert advice["value"] is None
    assert advice["action"] == "min_checkpoint_period: null"


def test_overflow_is_infinite_not_an_error():
    t = expected_seconds(1e9, 1e9, 10.0, 10.0, 1.0)
    assert t == math.inf
    advice = compare(_inputs(total_batches=10**8, nodes=1000, slots=1000, mttf_hours=1.0,
                             checkpoint_period_batches=None)).advice
    assert advice is not None
    assert advice["predicted_time_saving_fraction"] == 1.0


@pytest.mark.parametrize(("text", "value"), [("2.5", 2.5), ("$2.50", 2.5), (" $ 3 ", 3.0), ("1e-3", 1e-3)])
def test_parse_price(text, value):
    assert parse_price(text) == value


@pytest.mark.parametrize("text", ["", "$", "abc", "0", "-1", "$-2", "nan", "inf", "2.5$", "2,50"])
def test_parse_price_refuses(text):
    with pytest.raises(UserError, match="--price") as err:
        parse_price(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", ["", "abc", "0", "-5", "nan", "inf", "$100"])
def test_parse_mttf_refuses(text):
    with pytest.raises(UserError, match="--mttf") as err:
        parse_mttf_hours(text)
    assert "\n" not in str(err.value)


def test_parse_mttf():
    assert parse_mttf_hours(" 1000 ") == 1000.0
    assert parse_mttf_hours("0.5") == 0.5


@pytest.mark.parametrize("over", [{"step_seconds": 0.0}, {"total_batches": 0}, {"checkpoint_seconds": -1.0},
                                  {"restart_seconds": math.nan}, {"nodes": 0}, {"slots": 1, "nodes": 2},
                                  {"mttf_hours": 0.0}, {"price_per_slot_hour": -1.0},
                                  {"checkpoint_period_batches": 0}])
def test_bad_inputs_name_the_field(over):
    with pytest.raises(UserError, match=next(iter(over))):
        _inputs(**over)


def test_the_doctor_says_what_mttf_gives_with_advice_and_without(tmp_path):
    """``doctor --mttf`` printed nothing where the period was already right, and its advice read as a Python dict."""
    from helpers import cli_in_process
    from profiles import make_profile, write

    from dtrain.explain.diagnosis import config_text

    (tmp_path / "config.yaml").write_text("name: x\nmax_length:\n  batches: 100000\nmin_checkpoint_period:\n"
                                          "  batches: 2000\n")
    write(tmp_path, make_profile([{"forward": 0.01, "backward": 0.02, "comm_exposed": 0.01}] * 2))
    kept = cli_in_process("doctor", str(tmp_path), "--mttf", "1e6", "--price", "3")
    line = next(ln for ln in kept.stdout.splitlines() if ln.startswith("checkpoints:"))
    assert "keep min_checkpoint_period {batches: 2000}" in line and "goodput" in line and "$" in line, line
    advised = cli_in_process("doctor", str(tmp_path), "--mttf", "0.02")
    line = next(ln for ln in advised.stdout.splitlines() if ln.startswith("checkpoints:"))
    assert line.startswith("checkpoints: min_checkpoint_period: {batches: ") and "1 node sees" in line, line
    assert config_text({"batches": 5}) == "{batches: 5}" and config_text(None) == "null"
