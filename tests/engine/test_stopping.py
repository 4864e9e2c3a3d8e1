"""Stop votes on one rank, in-process: cast at one batch, read one aggregation group later; and a stop
request that rides on a report's all-reduce (two ranks).

The two-rank agreement through a signal is tests/launcher/test_reliability.py's SIGTERM test."""

from __future__ import annotations

import json

import pytest
from helpers import copy_trial, run_ranks, tiny_config

from dtrain.engine import stopping
from dtrain.engine.stopping import StopVote
from dtrain.engine.watchdog import STOP


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stopping.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(stopping, "TARGET_SECONDS", 0.5)  # the distances below are worked out for 0.5 s
    return now


@pytest.fixture
def no_stop_request():
    STOP.requested = False
    yield STOP
    STOP.requested = False


def _two_ranks(vote: StopVote, monkeypatch, others=(0, -(10**9))) -> StopVote:
    """The protocol as on two ranks, in-process: the other rank's flag and -proposal arrive on wait."""
    import torch

    def all_reduce(buf, op, group, async_op):
        return _Work(buf, torch.tensor(others))

    monkeypatch.setattr(stopping.dist, "all_reduce", all_reduce)
    vote.world = 2
    return vote


def test_votes_come_every_target_seconds_on_aggregation_boundaries_and_carry_a_stop_request(clock, no_stop_request,
                                                                                          monkeypatch):
    vote = _two_ranks(StopVote(enabled=True, start_batch=0, group_size=4, backend="gloo"), monkeypatch)
    assert vote.next_at == 4 and not vote.due(3, sync=False) and not vote.due(4, sync=False)
    assert vote.due(4, sync=True)
    clock[0] += 4 * 0.001  # 1 ms per batch: the next vote ~TARGET_SECONDS later, on a multiple of 4
    assert vote.vote(4) is False  # cast at 4; its result is read one group later
    assert vote.next_at == 8 and vote.vote(8) is False
    distance = vote.next_at - 4  # counted from the cast
    assert distance % 4 == 0 and abs(distance * 0.001 - stopping.TARGET_SECONDS) <= 4 * 0.001
    no_stop_request.requested = True
    cast = vote.next_at
    clock[0] += (cast - 4) * 0.001
    assert vote.vote(cast) is False  # the request travels with this vote...
    no_stop_request.requested = False  # (a later change of the flag is not part of it)
    assert vote.next_at == cast + 4 and vote.vote(cast + 4) is True  # ...and stops every rank one group later


def test_a_vote_in_flight_when_the_loop_ends_is_settled(clock, no_stop_request, monkeypatch):
    vote = _two_ranks(StopVote(enabled=True, start_batch=0, group_size=1, backend="gloo"), monkeypatch)
    assert vote.vote(1) is False
    vote.settle()
    assert vote.next_at == 2 and vote.vote(2) is False  # a fresh cast, not a read of the settled one
    vote.settle()
    vote.settle()  # nothing in flight: nothing to do


def test_a_disabled_vote_is_never_due(no_stop_request):
    vote = StopVote(enabled=False, start_batch=0, group_size=1, backend="gloo")
    no_stop_request.requested = True
    assert not vote.due(10**9, sync=True)


def test_a_single_rank_stops_at_the_first_group_end_after_the_request(no_stop_request):
    vote = StopVote(enabled=True, start_batch=0, group_size=2, backend="gloo")
    assert vote.due(2, sync=True) and vote.vote(2) is False  # the first scheduled look: no request yet
    assert not vote.due(10**6, sync=True)  # no schedule alone: only a request makes a batch due
    no_stop_request.requested = True
    assert not vote.due(3, sync=False) and vote.due(4, sync=True) and vote.vote(4) is True


class _Work:
    """A stand-in for an all-reduce in flight: counts waits, and delivers the other rank's values on wait."""

    def __init__(self, buf, others):
        self.buf, self.others, self.waits = buf, others, 0

    def wait(self):
        self.waits += 1
        self.buf.copy_(self.buf.maximum(self.others))  # MAX with the other rank's flag and -proposal


def test_the_all_reduce_is_waited_for_only_where_its_result_is_read_or_the_loop_ends(clock, no_stop_request,
                                                                                 monkeypatch):
    import torch

    works = []

    def all_reduce(buf, op, group, async_op):
        assert async_op  # never blocks where it is cast
        works.append(_Work(buf, torch.tensor([1, -3])))  # the other rank asks to stop and proposes 3 batches
        return works[-1]

    monkeypatch.setattr(stopping.dist, "all_reduce", all_reduce)
    vote = StopVote(enabled=True, start_batch=0, group_size=1, backend="gloo")
    vote.world = 2
    clock[0] += 0.001
    assert vote.vote(1) is False and works[0].waits == 0  # cast: nothing waited for
    assert vote.vote(2) is True and works[0].waits == 1  # read: the other rank's request stops this one too
    assert vote.next_at == 4  # the smallest proposal (3), counted from the cast at 1
    assert vote.vote(4) is False and works[1].waits == 0
    vote.settle()
    assert works[1].waits == 1


def test_a_report_carries_the_flag_and_a_proposal_and_moves_the_next_vote(clock, no_stop_request, monkeypatch):
    vote = _two_ranks(StopVote(enabled=True, start_batch=0, group_size=2, backend="gloo"), monkeypatch)
    # Times in powers of two, exact in binary: 1/128 s per batch, so votes 64 batches apart.
    clock[0] += 10 / 128
    assert vote.ride(10) == [0.0, 64.0]
    assert not vote.due(11, sync=True)  # no vote while the report's all-reduce is in flight
    vote.carried(10, flags=0.0, proposals=64.0 + 32.0, world=2)  # read after batch 11: the mean, from the report
    assert vote.next_at == 58
    clock[0] += 10 / 16  # the steps slowed down to 1/16 s: the next report brings the vote sooner
    assert vote.ride(20) == [0.0, 8.0]
    vote.carried(20, 0.0, 7.0 + 7.0, 2)
    assert vote.next_at == 28  # 7 batches, in whole aggregation groups
    assert vote.vote(28) is False and vote.next_at == 30  # cast: its read is due one group later...
    vote.carried(29, 0.0, 200.0, 2)
    assert vote.next_at == 30  # ...and a report read meanwhile leaves it there
    no_stop_request.requested = True
    clock[0] += 2 / 16
    assert vote.ride(30) == [1.0, 8.0]  # a report at the batch where the vote is read


def test_a_vote_cast_at_a_reports_batch_proposes_what_the_report_did(clock, no_stop_request, monkeypatch):
    import torch

    casts = []

    def all_reduce(buf, op, group, async_op):
        casts.append(buf.clone())
        return _Work(buf, torch.tensor([0, -(10**9)]))

    monkeypatch.setattr(stopping.dist, "all_reduce", all_reduce)
    vote = StopVote(enabled=True, start_batch=0, group_size=1, backend="gloo")
    vote.world = 2
    clock[0] += 1 / 64
    assert vote.ride(1) == [0.0, 32.0]
    assert vote.vote(1) is False and casts[0].tolist() == [0, -32]  # no time passed since the report


def test_a_stop_heard_through_a_report_stops_at_the_next_group_end(clock, no_stop_request, monkeypatch):
    import torch

    works = []

    def all_reduce(buf, op, group, async_op):
        works.append(_Work(buf, torch.tensor([0, -100])))
        return works[-1]

    monkeypatch.setattr(stopping.dist, "all_reduce", all_reduce)
    vote = StopVote(enabled=True, start_batch=0, group_size=2, backend="gloo")
    vote.world = 2
    assert vote.vote(2) is False  # cast, in flight
    vote.carried(2, flags=1.0, proposals=0.0, world=2)  # a report read at batch 3: some rank asked to stop
    assert not vote.due(3, sync=False) and vote.due(4, sync=True)
    vote.carried(3, 0.0, 10.0**6, 2)
    assert vote.due(4, sync=True)  # a later report cannot put the stop off
    assert vote.vote(4) is True and works[0].waits == 1  # the vote in flight is settled first
    assert vote.vote(6) is True


STOPPER = """
from tiny import TinyTrial

from dtrain.engine.watchdog import STOP


class Stopper(TinyTrial):
    def train_batch(self, batch, epoch_idx, batch_idx):
        if batch_idx == 5 and self.context.rank == 1:
            STOP.requested = True  # what the launcher's SIGUSR1 does; rank 0 is never asked
        return super().train_batch(batch, epoch_idx, batch_idx)
"""


def _train_until_stopped(rank, world, folder):
    from dtrain.config.schema import load_config
    from dtrain.engine.trainer import run_trial

    # Every rank proposes votes 20 batches apart: the first vote, cast at batch 1 and read at 2, puts the
    # next at 21, so no vote is cast before it and only a report can carry rank 1's request.
    stopping.StopVote._proposal = lambda self, batch: 20
    return run_trial(load_config(folder / "experiment.yaml"), folder / "run", None, quiet=True)


@pytest.mark.slow
def test_ranks_stop_together_on_a_request_carried_by_held_back_reports(tmp_path):
    copy_trial(tmp_path)
    (tmp_path / "stopper.py").write_text(STOPPER)
    tiny_config(tmp_path, entrypoint="stopper:Stopper", scheduling_unit=8, **{"hyperparameters.val_size": 0})
    (tmp_path / "run" / "logs").mkdir(parents=True)  # the launcher's, where the chief records the stop
    results = run_ranks(_train_until_stopped, world_size=2, timeout=90, args=(tmp_path,))
    # Asked at batch index 5 on rank 1. The report after batch 8 is held back (the next, at 16, still comes
    # before the vote at 21); the one after batch 16 sends both and carries the request, read after 17.
    assert results == [{"stopped_at": 17}, {"stopped_at": 17}]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "17"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["batches"] for r in records if r["kind"] == "training"] == [8, 16]  # the held one too, in order
