"""The parameter server's own advice, in-process (its training runs are in test_strategies.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from dtrain.sync.options import ParameterServerOptions
from dtrain.sync.parameter_server import ParameterServerStrategy


def _warned(caplog: pytest.LogCaptureFixture, mode: str, workers: int, momentum: float) -> str:
    # The check reads only the roles and the options: a stand-in spares a process group.
    strategy = SimpleNamespace(worker_ranks=list(range(workers)), options=ParameterServerOptions(mode=mode))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=momentum)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ParameterServerStrategy._warn_of_momentum(strategy, optimizer)  # type: ignore[arg-type]
    return caplog.text


def test_async_workers_with_a_high_momentum_are_warned_that_staleness_adds_its_own(caplog):
    # Measured on examples/digits (2 workers, lr 0.1): momentum 0.9 validated at 0.48, 0.5 at 0.97.
    text = _warned(caplog, "async", 2, 0.9)
    assert "staleness acts as momentum of its own (about 0.50) on top of the optimizer's 0.9" in text
    assert "lower the momentum or the learning rate" in text
    assert _warned(caplog, "async", 2, 0.4) == ""  # below the line: no advice
    assert _warned(caplog, "async", 1, 0.9) == ""  # one worker: its gradients are never stale
    assert _warned(caplog, "sync", 2, 0.9) == ""  # sync is all-reduce SGD
