"""Stop votes on one rank (in-process; the two-rank agreement is tests/test_reliability.py's SIGTERM test)."""

from __future__ import annotations

import pytest

from dtrain import stopping
from dtrain.stopping import TARGET_SECONDS, StopVote
from dtrain.watchdog import STOP


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stopping.time, "monotonic", lambda: now[0])
    return now


@pytest.fixture
def no_stop_request():
    STOP.requested = False
    yield STOP
    STOP.requested = False


def test_votes_come_every_target_seconds_on_aggregation_boundaries_and_carry_a_stop_request(clock, no_stop_request):
    vote = StopVote(enabled=True, start_batch=0, group_size=4, backend="gloo")
    assert vote.next_at == 4 and not vote.due(3, sync=False) and not vote.due(4, sync=False)
    assert vote.due(4, sync=True)
    clock[0] += 4 * 0.001  # 1 ms per batch: the next vote ~TARGET_SECONDS later, on a multiple of 4
    assert vote.vote(4) is False
    distance = vote.next_at - 4
    assert distance % 4 == 0 and abs(distance * 0.001 - TARGET_SECONDS) <= 4 * 0.001
    no_stop_request.requested = True
    clock[0] += distance * 0.001
    assert vote.vote(vote.next_at) is True


def test_a_disabled_vote_is_never_due(no_stop_request):
    vote = StopVote(enabled=False, start_batch=0, group_size=1, backend="gloo")
    assert not vote.due(10**9, sync=True)
