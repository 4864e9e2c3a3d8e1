"""A doctor factor plugs in by registering itself: this file adds one without touching dtrain's modules."""

import json

import pytest
from profiles import make_profile

from dtrain.explain.diagnosis import Advice
from dtrain.explain.factors import registry
from dtrain.explain.factors.base import Context, Factor

STEP = {"data": 0.001, "forward": 0.004, "backward": 0.004, "optimizer": 0.004, "other": 0.001}


class ToyFactor(Factor):
    """A toy factor: no seconds of its own, and a change priced by the cost model."""

    name = "toy_factor"

    def seconds(self, ctx: Context) -> float:
        return 0.0

    def advise(self, ctx: Context) -> Advice:
        gain = ctx.predictor.gain("hyperparameters.global_batch_size: 128", global_batch=128)
        return Advice("hyperparameters.global_batch_size", 128, "a toy's reason", gain)


@pytest.fixture
def toy():
    registry.register(ToyFactor)
    yield
    registry.unregister(ToyFactor.name)


def test_a_registered_factor_is_diagnosed_and_predicted_by_the_cost_model(toy):
    from dtrain.explain.doctor import diagnose

    assert registry.names()[-1] == "toy_factor" and registry.names()[0] == "communication"
    # Its forward and backward were timed at twice the batch: the batch-size factor predicts (else a bound only).
    grows = {"per_slot_batch_size": 64, "work_seconds": 0.008, "work_double_seconds": 0.014, "load_seconds": 0.001,
             "load_double_seconds": 0.002}
    profile = make_profile([STEP], "vm", batch_scaling=grows)
    diagnosis = diagnose(profile)
    row = diagnosis.factor("toy_factor")
    assert row is not None and row.why == "a toy's reason" and row.share == 0
    # Its gain is the predictor's for the same change (the batch-size factor asks for 2x the batch too).
    batch = diagnosis.factor("batch_size")
    assert batch is not None and row.predicted_interval == batch.predicted_interval
    assert row.predicted_speedup == batch.predicted_speedup
    assert sum(f.share for f in diagnosis.factors) == pytest.approx(1.0)
    assert "toy_factor" in json.dumps(diagnosis.to_json())


def test_the_builtin_factors_in_their_order():
    assert registry.names() == ("communication", "data_loading", "compute", "precision", "straggler", "batch_size",
                                "sync_frequency")
