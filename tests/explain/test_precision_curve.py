"""A precision's gain at another per-slot batch and thread count than the run's (explain/precision.py's curve):
from the model's steps timed at the batch and twice it, on the run's threads and another count."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
from profiles import make_profile

from dtrain.explain import precision
from dtrain.explain.calibration import stored_target
from dtrain.explain.costmodel import CostModel
from dtrain.explain.plan import cases
from dtrain.explain.predictor import target_at

OPTIMIZER = 0.001  # the run's optimizer step (float32 in any precision): out of every timed step

# Seconds per step (optimizer included) at (precision, batch factor, threads), the run on 1 thread at 32 samples:
# float32 a fixed 2 ms and 0.25 ms a sample-block; bf16 (no bf16 units) 1 ms fixed, 8 ms per block, and its
# thread scaling poorer than float32's.
TIMED = {("32-true", 1, 1): 0.004, ("32-true", 2, 1): 0.006, ("bf16-mixed", 1, 1): 0.010, ("bf16-mixed", 2, 1): 0.019,
         ("32-true", 1, 2): 0.0025, ("32-true", 2, 2): 0.0035, ("bf16-mixed", 1, 2): 0.008,
         ("bf16-mixed", 2, 2): 0.015}


def _profile(timed: dict | None = None, shapes: bool = True, optimizer: float = OPTIMIZER):
    timed = timed or TIMED
    steps = {"per_slot_batch_size": 32, "run_precision": "32-true", "steps_timed": 5, "skipped": {},
             "seconds_per_step": {p: timed[(p, 1, 1)] for p in ("32-true", "bf16-mixed")},
             "double_batch_seconds_per_step": timed[("32-true", 2, 1)], "double_batch_skipped": None,
             "cost_seconds": 0.5, "relative_spread": {"32-true": 0.01, "bf16-mixed": 0.01, "double": 0.01},
             "threads": 1,
             "shapes": [{"precision": p, "batch_factor": b, "threads": t, "seconds": s, "relative_spread": 0.02}
                        for (p, b, t), s in timed.items() if (b, t) != (1, 1) and (p, b, t) != ("32-true", 2, 1)]
             if shapes else []}
    solo = {"per_slot_batch_size": 32, "points": [
        {"threads": 1, "work_seconds": 0.003, "work_double_seconds": 0.005, "optimizer_seconds": 0.0010},
        {"threads": 2, "work_seconds": 0.0015, "work_double_seconds": 0.0025, "optimizer_seconds": 0.0005}]}
    return make_profile([{"data": 0.0002, "forward": 0.0012, "backward": 0.0018, "optimizer": optimizer}],
                        global_batch_size=32, threads_per_slot=1, model_steps=steps, solo_probe=solo)


def _gain(batch_factor: int, threads: int, optimizer: float) -> float:
    """bf16-mixed's gain over float32 as timed at one shape, the optimizer's step out of both."""
    return ((TIMED[("32-true", batch_factor, threads)] - optimizer)
            / (TIMED[("bf16-mixed", batch_factor, threads)] - optimizer))


def test_the_curve_gives_each_timed_shape_its_own_gain_and_the_run_shape_the_plain_one():
    profile = _profile()
    found = precision.estimate(profile, "bf16-mixed")
    curve = found.curve
    assert curve is not None and [line.threads for line in curve.lines] == [1, 2]
    # At the run's shape, exactly the gain the run's own settings give (the optimizer out of both).
    assert found.gain == pytest.approx(0.003 / 0.009) and curve.at(32, 1) == pytest.approx(found.gain)
    # Twice the batch on the run's threads: the two settings timed there.
    assert curve.at(64, 1) == pytest.approx(_gain(2, 1, OPTIMIZER))
    # On two threads the optimizer's step is the solo probe's there (half the run's).
    half = OPTIMIZER / 2
    assert curve.at(32, 2) == pytest.approx(_gain(1, 2, half))
    assert curve.at(64, 2) == pytest.approx(_gain(2, 2, half))
    # Each precision's step is a fixed part and a per-sample part: far out, the ratio of the per-sample parts,
    # not the run's gain carried unchanged (0.33x here, 0.25x at 1,000 times the batch).
    assert curve.at(32_000, 1) == pytest.approx(0.002 / 0.009, rel=0.01)
    # Beyond the thread counts timed the gain is held at the nearest; between them, in 1 / threads.
    assert curve.at(32, 8) == pytest.approx(curve.at(32, 2))
    assert min(curve.at(32, 1), curve.at(32, 2)) < curve.at(32, 1.5) < max(curve.at(32, 1), curve.at(32, 2))  # type: ignore[arg-type]
    assert "twice" in found.source and "other thread counts" in found.source


def test_a_profile_of_an_older_dtrain_keeps_one_gain_at_every_shape():
    found = precision.estimate(_profile(shapes=False), "bf16-mixed")
    assert found.curve is None and found.gain == pytest.approx(0.003 / 0.009)


def test_a_step_that_shrinks_at_twice_the_batch_is_held_flat_not_negative():
    """Noise can time twice the batch faster than the batch: the line is then flat (no per-sample part)."""
    timed = {**TIMED, ("bf16-mixed", 2, 1): 0.009}
    curve = precision.estimate(_profile(timed), "bf16-mixed").curve
    assert curve is not None
    line = curve.lines[0]
    assert line.other_per_batch == 0 and line.other_fixed == pytest.approx(0.009)
    assert all(curve.at(b, 1) > 0 for b in (1, 32, 64, 1e6))


def test_the_cost_model_prices_another_slot_count_at_the_shape_it_gives_a_slot():
    """From a 1-thread run on 2 cores: one slot of twice the batch on both cores gets the curve's gain there, not
    the run's; the plan's row says so, and a stored bench row keeps the curve."""
    profile = _profile()
    model = CostModel.from_profile(profile)
    found = precision.estimate(profile, "bf16-mixed")
    assert found.curve is not None
    target = replace(target_at(model, 1, 1, global_batch=64, **found.changes()), threads=2)
    plain = replace(target, precision_curve=None)
    compute, carried = model.predict(target).parts["compute"], model.predict(plain).parts["compute"]
    assert compute == pytest.approx(carried * found.gain / found.curve.at(64, 2))
    assert stored_target(asdict(target)) == target
    rows = [c for c in cases(model, profile, [1], 1) if c.option == "precision"]
    assert rows and "from steps of 32 and 64 samples" in rows[0].label
