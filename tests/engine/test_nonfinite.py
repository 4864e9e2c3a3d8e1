"""The non-finite watch: the first batch whose loss is nan or inf, from host values and CPU tensors, and
how a report carries it across ranks."""

import math

import pytest
import torch
from helpers import run_ranks

from dtrain.engine.nonfinite import NonFiniteWatch


@pytest.mark.parametrize("as_tensor", [True, False])
def test_the_first_non_finite_batch_is_kept(as_tensor):
    watch = NonFiniteWatch(torch.device("cpu"))
    losses = {3: 1.0, 4: math.nan, 5: 2.0, 6: math.inf}
    for batch, loss in losses.items():
        value = torch.tensor(loss, requires_grad=True) * 1 if as_tensor else loss
        watch.observe({"loss": value, "accuracy": 0.5}, batch)
    assert watch.first() == (0, 4)  # (rank, batch) in a world of one


def test_finite_losses_leave_nothing_to_report():
    watch = NonFiniteWatch(torch.device("cpu"))
    for batch in range(3):
        watch.observe({"loss": torch.tensor(0.5)}, batch)
    watch.observe({}, 3)  # a trial that reports nothing
    assert watch.first() is None


def test_seen_says_whether_a_loss_was_non_finite():
    for as_tensor in (True, False):
        watch = NonFiniteWatch(torch.device("cpu"))
        watch.observe({"loss": torch.tensor(0.5) if as_tensor else 0.5}, 0)
        assert float(watch.seen()) == 0.0
        watch.observe({"loss": torch.tensor(math.nan) if as_tensor else math.nan}, 1)
        assert float(watch.seen()) == 1.0


def _report_across_ranks(rank: int, world: int) -> dict:
    """A report as the trainer makes it: sums and the non-finite flag in one all-reduce, launched, then
    another collective (the next step's gradients), then read."""
    import torch.distributed as dist

    from dtrain.engine.metrics import MeanAccumulator, SumInFlight, means_of

    dist.init_process_group("gloo")  # from the rank's environment (tests/helpers.py)
    acc, watch = MeanAccumulator(), NonFiniteWatch(torch.device("cpu"))
    for batch in range(3):
        loss = math.nan if (rank, batch) == (1, 2) else float(rank + batch)
        acc.add({"loss": loss if batch < 2 else 1.0, "acc": torch.tensor(0.25 * rank)})
        watch.observe({"loss": loss}, batch)
    names, values = acc.packed()
    inflight = SumInFlight([*values, watch.seen()])
    dist.all_reduce(torch.ones(4))  # the next step's exchange, queued behind the report's
    summed = inflight.wait()
    flag = summed.pop()
    out = {"means": means_of(names, summed, inflight.world), "flag": flag, "first": watch.first()}
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_a_report_sums_metrics_and_the_non_finite_flag_in_one_all_reduce():
    results = run_ranks(_report_across_ranks, world_size=2, timeout=60)
    # losses: rank 0 [0, 1, 1], rank 1 [1, 2, 1] -> mean 1.0; acc: rank 0 0.0, rank 1 0.25 -> 0.125
    assert results[0] == results[1] == {"means": {"acc": 0.125, "loss": 1.0}, "flag": 1.0, "first": (1, 2)}
