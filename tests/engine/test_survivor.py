"""A lost peer's survivors: which step their state is complete at, how they agree, and when they fall back.

In-process, with a stand-in for the step loop: the real save with real processes is in
tests/launcher/test_elastic.py (a node killed outright).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dtrain.engine import checkpoint, survivor
from dtrain.launcher import membership


def _loop(tmp: Path, *, batches: int, steps: int, k: int = 1, total: int = 100, resumed_at: int = 0,
          step_end: object = None, **strategy: bool) -> SimpleNamespace:
    flags = {"per_rank_optimizer_state": False, "replicas_may_differ": False, "has_server_ranks": False, **strategy}
    ctx = SimpleNamespace(strategy=SimpleNamespace(name="ddp", **flags), aggregation_frequency=k,
                          optimizer_steps=steps, optimizers=[object()], rank=1, world_size=2, is_chief=False)
    return SimpleNamespace(ctx=ctx, batches=batches, total_batches=total, resumed_at=resumed_at,
                           callbacks=SimpleNamespace(step_end=step_end), run_dir=tmp, ckpt_root=tmp / "checkpoints")


def test_the_exchange_schedule_counts_every_kth_batch_and_the_last():
    assert [survivor.last_exchange(b, 4, 10) for b in (3, 4, 7, 8, 9, 10)] == [0, 4, 4, 8, 8, 10]
    assert survivor.exchanges_between(0, 8, 4, 10) == 2
    assert survivor.exchanges_between(4, 10, 4, 10) == 2  # batch 8, and 10 (the run's last, a shorter group)
    assert survivor.exchanges_between(0, 47, 1, 100) == 47


def test_the_state_is_complete_at_the_last_exchange_when_the_optimizer_agrees(tmp_path):
    # Failed in the backward of batch 48 (k=1): 47 batches trained since batch 0, 47 optimizer steps.
    assert survivor.complete_batch(_loop(tmp_path, batches=47, steps=47), 0) == (47, "")
    # Resumed at 20 with 20 steps: the count starts there.
    assert survivor.complete_batch(_loop(tmp_path, batches=47, steps=47, resumed_at=20), 20) == (47, "")
    # Aggregating 4 batches: mid-group at 46, the model is as of batch 44 (accumulated gradients are not kept).
    assert survivor.complete_batch(_loop(tmp_path, batches=46, steps=11, k=4), 0) == (44, "")


def test_a_survivor_that_cannot_be_sure_saves_nothing(tmp_path):
    batch, why = survivor.complete_batch(_loop(tmp_path, batches=47, steps=48), 0)  # stepped during the failure
    assert batch is None and "cut a step in half" in why
    batch, why = survivor.complete_batch(_loop(tmp_path, batches=46, steps=11, k=4, step_end=print), 0)
    assert batch is None and "callbacks ran on batches 45-46" in why
    for flag in ("per_rank_optimizer_state", "replicas_may_differ", "has_server_ranks"):
        batch, why = survivor.complete_batch(_loop(tmp_path, batches=47, steps=47, **{flag: True}), 0)
        assert batch is None and "not replicated" in why, flag


def _fake_save(loop: SimpleNamespace, batch: int) -> None:
    """A checkpoint as the survivor writes it (marked ``survivor``), without a real model."""
    payload = checkpoint.CheckpointPayload(batch, [{"w": torch.ones(2)}], [], {"extra": {
        "batches": batch, "survivor": {"rank": loop.ctx.rank}}}, {"world_size": 2})
    checkpoint.save(loop.ckpt_root, payload, {"batches": batch, "rng": {}}, 0, keep_last=3)


def _periodic(root: Path, batch: int) -> None:
    payload = checkpoint.CheckpointPayload(batch, [{"w": torch.zeros(2)}], [], {"extra": {"batches": batch}}, {})
    checkpoint.save(root, payload, {"batches": batch, "rng": {}}, 0, keep_last=3)


def test_survivors_that_agree_save_once_and_the_others_check_the_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(survivor, "_save", _fake_save)
    folder = tmp_path / "votes"
    first, second = _loop(tmp_path, batches=47, steps=47), _loop(tmp_path, batches=47, steps=47)
    second.ctx.rank = 2
    _periodic(first.ckpt_root, 40)
    assert survivor._save_or_compare(first, folder, 47)[0] is True
    saved, why = survivor._save_or_compare(second, folder, 47)
    assert not saved and why.startswith("kept: rank 1 saves batch 47"), why
    assert checkpoint.latest(first.ckpt_root).name == "47"


@pytest.mark.parametrize("winner_first", [True, False])
def test_survivors_that_disagree_fall_back_to_the_latest_checkpoint(tmp_path, monkeypatch, winner_first):
    """Whichever of the two looks last (the claim's saver after its commit, or the disagreeing survivor)
    withdraws the survivor checkpoint: ``latest`` names the periodic one again."""
    monkeypatch.setattr(survivor, "_save", _fake_save)
    folder = tmp_path / "votes"
    winner, other = _loop(tmp_path, batches=47, steps=47), _loop(tmp_path, batches=46, steps=46)
    other.ctx.rank = 2
    _periodic(winner.ckpt_root, 40)
    if winner_first:
        assert survivor._save_or_compare(winner, folder, 47)[0] is True
        saved, why = survivor._save_or_compare(other, folder, 46)
        assert "withdrawn" in why
    else:  # the disagreement is marked while the claim's saver is still saving
        survivor._write_new(folder / survivor.CLAIM, {"rank": 1, "batch": 47})
        saved, why = survivor._save_or_compare(other, folder, 46)
        monkeypatch.setattr(survivor, "_write_new", lambda path, record: True)  # it holds the claim
        saved, why = survivor._save_or_compare(winner, folder, 47)
    assert not saved and "disagree" in why
    assert checkpoint.latest(winner.ckpt_root).name == "40"


def test_the_record_says_where_the_job_continued_from_and_why(tmp_path):
    logs, root = tmp_path / "logs", tmp_path / "checkpoints"
    _periodic(root, 40)
    folder = survivor.world_folder(logs, 0, 2)
    survivor._write_vote(folder, survivor.Vote(0, 123, None, False, "sync.strategy fsdp keeps part of the "
                                               "training state on each rank (not replicated)", time.time()))
    assert survivor.voters(logs) == {123}
    found = membership.recovery(logs, root / "40")
    assert found == {"recovered_from": "checkpoint", "fallback_reason": "sync.strategy fsdp keeps part of the "
                     "training state on each rank (not replicated)"}
    line = membership.describe({"cause": "lost", "node": "vm-2", "old_world_size": 2, "new_world_size": 1,
                                "batches": 40, "seconds": 7.0, "lost_batches": 7, **found})
    assert line.endswith("7 batch(es) lost; fell back to the latest checkpoint (sync.strategy fsdp keeps part of "
                         "the training state on each rank (not replicated))")
    _fake_save(_loop(tmp_path, batches=47, steps=47), 47)
    assert membership.recovery(logs, root / "47") == {"recovered_from": "survivors"}


def test_a_second_crash_while_the_survivor_saves_leaves_the_latest_checkpoint_and_says_so(tmp_path, monkeypatch):
    """The save is cut midway (the disk, a kill): nothing half-written is used; the vote says why, and the
    job falls back to the checkpoint before."""
    loop = _loop(tmp_path, batches=47, steps=47)
    _periodic(loop.ckpt_root, 40)
    monkeypatch.setattr(survivor, "_save", _fake_save)
    monkeypatch.setattr(survivor, "dist", SimpleNamespace(world_size=lambda: 2))  # as in a job of two
    monkeypatch.setenv(survivor.ENABLE_ENV, "1")  # an elastic job's worker

    def cut(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_commit", cut)
    survivor.keep_state(loop, RuntimeError("Connection reset by peer"), 0)
    assert checkpoint.latest(loop.ckpt_root).name == "40"
    [vote] = survivor.read_votes(survivor.world_folder(tmp_path / "logs", 0, 2)).values()
    assert vote.batch is None and not vote.saved and "the survivor save failed (OSError" in vote.reason
    assert membership.recovery(tmp_path / "logs", loop.ckpt_root / "40")["recovered_from"] == "checkpoint"
    # An error of the rank's own (not a lost peer) keeps nothing and votes nothing.
    survivor.keep_state(loop, RuntimeError("CUDA out of memory"), 0)
    assert len(survivor.read_votes(survivor.world_folder(tmp_path / "logs", 0, 2))) == 1
