"""The non-finite watch: the first batch whose loss is nan or inf, from host values and CPU tensors."""

import math

import pytest
import torch

from dtrain.nonfinite import NonFiniteWatch


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
