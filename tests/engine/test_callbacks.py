"""Loop callbacks (dtrain.LoopCallback): where each hook fires and with what, their state through a
checkpoint and a resume, their failures in one line, and a loop that pays nothing for hooks nobody overrides."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from helpers import cli_in_process, copy_trial, run_ranks, tiny_config

import dtrain
from dtrain.engine.callbacks import Callbacks
from dtrain.errors import UserError

RECORDER = '''
import json
from pathlib import Path

import torch
from tiny import TinyTrial

import dtrain
from dtrain.engine.watchdog import STOP


class Recorder(dtrain.LoopCallback):
    """Writes every hook it sees to events<rank>.jsonl; counts steps and epochs as its checkpointed state."""

    def __init__(self, trial):
        self.trial, self.rank = trial, trial.context.rank
        self.steps, self.total, self.epochs_ended = 0, torch.zeros(()), []
        self.path = Path(trial.hp["events_dir"]) / f"events{self.rank}.jsonl"

    def _event(self, *args):
        with self.path.open("a") as f:
            f.write(json.dumps(args) + "\\n")

    def on_trial_startup(self, first_batch_idx, checkpoint_dir):
        self.resumed = first_batch_idx > 0
        self._event("on_trial_startup", first_batch_idx, checkpoint_dir, self.steps)

    def on_training_start(self):
        self._event("on_training_start")

    def on_training_epoch_start(self, epoch_idx):
        self._event("on_training_epoch_start", epoch_idx)

    def on_step_end(self, batch_idx):
        self.steps += 1
        self.total += batch_idx
        self._event("on_step_end", batch_idx)
        if batch_idx == self.trial.hp.get("raise_at_batch"):
            raise RuntimeError(f"callback failed at batch {batch_idx}")
        if batch_idx == self.trial.hp.get("stop_at_batch") and not self.resumed:
            STOP.requested = True  # what the launcher's SIGTERM does: every rank agrees to stop, then checkpoints

    def on_training_epoch_end(self, epoch_idx):
        self.epochs_ended.append(epoch_idx)
        self._event("on_training_epoch_end", epoch_idx)

    def on_training_report(self, batches, metrics):
        self._event("on_training_report", batches, sorted(metrics))

    def on_validation_start(self):
        self._event("on_validation_start")

    def on_validation_end(self, metrics):
        self._event("on_validation_end", metrics)

    def on_checkpoint_save_start(self, checkpoint):
        checkpoint["note"] = f"saved by rank {self.rank}"
        self._event("on_checkpoint_save_start", checkpoint["batches"], sorted(checkpoint["callbacks"]))

    def on_checkpoint_write_end(self, checkpoint_dir):
        committed = Path(checkpoint_dir, "metadata.json").exists()
        latest = (Path(checkpoint_dir).parent / "latest").read_text().strip() == Path(checkpoint_dir).name
        self._event("on_checkpoint_write_end", Path(checkpoint_dir).name, committed and latest)

    def on_checkpoint_load_start(self, checkpoint):
        self._event("on_checkpoint_load_start", checkpoint["batches"], checkpoint.get("note"))

    def on_trial_shutdown(self):
        self._event("on_trial_shutdown", self.state_dict()["steps"], self.epochs_ended, float(self.total))

    def state_dict(self):
        return {"steps": self.steps, "total": self.total.clone(), "epochs_ended": list(self.epochs_ended),
                "rank": self.rank}

    def load_state_dict(self, state):
        self.steps, self.total, self.epochs_ended = state["steps"], state["total"], state["epochs_ended"]
        self.loaded_rank = state["rank"]
        self._event("load_state_dict", state["steps"], state["rank"])


class Quiet(dtrain.LoopCallback):
    """Overrides nothing: present in checkpoints, never called."""


class RecordingTrial(TinyTrial):
    def build_callbacks(self):
        return {"recorder": Recorder(self), "quiet": Quiet()}
'''


def _folder(tmp_path, **overrides):
    copy_trial(tmp_path)
    (tmp_path / "recorder.py").write_text(RECORDER)
    (tmp_path / "events").mkdir(exist_ok=True)
    (tmp_path / "run" / "logs").mkdir(parents=True, exist_ok=True)  # the launcher's, where a stop is recorded
    settings = {"entrypoint": "recorder:RecordingTrial", "hyperparameters.train_size": 64,
                "hyperparameters.val_size": 8, "hyperparameters.events_dir": str(tmp_path / "events"),
                "max_length": {"batches": 10}, "scheduling_unit": 4, "min_validation_period": {"batches": 5},
                "min_checkpoint_period": {"batches": 8}, **overrides}
    return tiny_config(tmp_path, **settings)


def _events(tmp_path, rank=0):
    return [json.loads(line) for line in (tmp_path / "events" / f"events{rank}.jsonl").read_text().splitlines()]


def _train(rank, world, folder, resume, votes_every=None):
    from dtrain.config.schema import load_config
    from dtrain.engine import stopping
    from dtrain.engine.trainer import run_trial

    if votes_every is not None:  # stop votes this many batches apart, not ~2 s: a stop lands within the run
        stopping.StopVote._proposal = lambda self, batch: votes_every
    run = folder / "run"
    return run_trial(load_config(folder / "experiment.yaml"), run, run / "checkpoints" if resume else None, quiet=True)


def test_hooks_fire_in_order_with_their_arguments(tmp_path):
    # 1 slot, 4 batches per epoch (64 records, 16 per batch), 10 batches: epochs 0 and 1 whole, 2 begun;
    # a report every 4 batches and at the end, validation every 5, a checkpoint at 8 and at the end.
    _folder(tmp_path, **{"resources.slots_per_trial": 1})
    run_ranks(_train, world_size=1, timeout=60, args=(tmp_path, False))
    events = _events(tmp_path)
    reports = [e for e in events if e[0] == "on_training_report"]
    validations = [e[1] for e in events if e[0] == "on_validation_end"]
    assert [e for e in events if e[0] not in ("on_training_report", "on_validation_end")] == [
        ["on_trial_startup", 0, None, 0], ["on_training_start"],
        ["on_training_epoch_start", 0], ["on_step_end", 0], ["on_step_end", 1], ["on_step_end", 2],
        ["on_step_end", 3], ["on_training_epoch_end", 0],
        ["on_training_epoch_start", 1], ["on_step_end", 4], ["on_validation_start"],
        ["on_step_end", 5], ["on_step_end", 6], ["on_step_end", 7], ["on_training_epoch_end", 1],
        ["on_checkpoint_save_start", 8, ["quiet", "recorder"]], ["on_checkpoint_write_end", "8", True],
        ["on_training_epoch_start", 2], ["on_step_end", 8], ["on_step_end", 9], ["on_validation_start"],
        ["on_checkpoint_save_start", 10, ["quiet", "recorder"]], ["on_checkpoint_write_end", "10", True],
        ["on_trial_shutdown", 10, [0, 1], float(sum(range(10)))],
    ]
    # Reports come when their all-reduce is read: after their batch's step, before what must follow them.
    assert [r[1:] for r in reports] == [[4, ["loss"]], [8, ["loss"]], [10, ["loss"]]]
    for batches, _ in (r[1:] for r in reports):
        assert events.index(["on_step_end", batches - 1]) < events.index(["on_training_report", batches, ["loss"]])
    assert events.index(["on_training_report", 8, ["loss"]]) < events.index(["on_checkpoint_save_start", 8,
                                                                              ["quiet", "recorder"]])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert validations == [r["metrics"] for r in records if r["kind"] == "validation"]
    assert [e[0] for e in events].index("on_validation_end") == [e[0] for e in events].index("on_validation_start") + 1
    saved = torch.load(tmp_path / "run" / "checkpoints" / "10" / "trainer_state.pt", weights_only=True)["extra"]
    assert saved["note"] == "saved by rank 0" and saved["callbacks"]["quiet"] == {}
    assert saved["callbacks"]["recorder"]["steps"] == 10 and saved["batches"] == 10


@pytest.mark.slow
def test_callback_state_continues_through_a_stop_and_a_resume(tmp_path):
    # Training metrics not averaged: rank 1's reports are its own means, read for its callback alone.
    _folder(tmp_path, **{"hyperparameters.stop_at_batch": 4, "optimizations.average_training_metrics": False})
    stopped = run_ranks(_train, world_size=2, timeout=90, args=(tmp_path, False, 2))
    at = stopped[0]["stopped_at"]
    assert stopped == [{"stopped_at": at}] * 2 and 5 <= at < 10  # the ranks agree at a vote after the request
    for rank in (0, 1):
        events = _events(tmp_path, rank)
        assert events[-1] == ["on_trial_shutdown", at, list(range(at // 4)), float(sum(range(at)))]
        assert ["on_checkpoint_write_end", str(at), True] in events
        assert ["on_training_report", 4, ["loss"]] in events
        own = torch.load(tmp_path / "run" / "checkpoints" / str(at) / f"rank{rank}.pt", weights_only=True)
        assert own["extra"]["callbacks"]["recorder"]["rank"] == rank  # each rank keeps its own state
    backup = tmp_path / "stopped"
    shutil.copytree(tmp_path / "run", backup)

    for rank in (0, 1):
        (tmp_path / "events" / f"events{rank}.jsonl").unlink()
    assert run_ranks(_train, world_size=2, timeout=90, args=(tmp_path, True))[0]["batches"] == 10
    for rank in (0, 1):
        events = _events(tmp_path, rank)
        assert events[:3] == [["on_checkpoint_load_start", at, "saved by rank 0"],
                              ["load_state_dict", at, rank],
                              ["on_trial_startup", at, str(tmp_path / "run" / "checkpoints" / str(at)), at]]
        assert ["on_training_epoch_start", at // 4] not in events or at % 4 == 0  # no epoch start mid-epoch
        assert events[-1] == ["on_trial_shutdown", 10, [0, 1], float(sum(range(10)))]  # as if never stopped

    # On another slot count the per-rank files are not used: every rank gets the chief's state.
    shutil.rmtree(tmp_path / "run")
    shutil.copytree(backup, tmp_path / "run")
    (tmp_path / "events" / "events0.jsonl").unlink()
    _folder(tmp_path, **{"hyperparameters.stop_at_batch": 4, "resources.slots_per_trial": 1})
    run_ranks(_train, world_size=1, timeout=60, args=(tmp_path, True))
    events = _events(tmp_path)
    assert events[1] == ["load_state_dict", at, 0] and events[-1][:2] == ["on_trial_shutdown", 10]


def test_a_raising_callback_fails_the_run_in_one_line(tmp_path):
    config = _folder(tmp_path, **{"hyperparameters.raise_at_batch": 3, "resources.slots_per_trial": 1})
    result = cli_in_process("run", str(config), "--run-dir", str(tmp_path / "failed"), "--quiet")
    assert result.code == 1
    assert "worker rank 0 failed: RuntimeError: callback failed at batch 3 (at " in result.stderr
    assert "recorder.py" in result.stderr and "Traceback" not in result.stderr


class _Counter(dtrain.LoopCallback):
    def on_step_end(self, batch_idx):
        pass


class _EpochsOnly(dtrain.LoopCallback):
    def on_training_epoch_end(self, epoch_idx):
        self.ended = [*getattr(self, "ended", []), epoch_idx]


def test_the_loop_calls_only_overridden_hooks():
    assert Callbacks({}, 4).step_end is None
    assert Callbacks({"plain": dtrain.LoopCallback()}, 4).step_end is None  # nothing per step to call
    assert Callbacks({"plain": dtrain.LoopCallback()}, 4)._on["on_validation_end"] == []
    assert Callbacks({"count": _Counter()}, 4).step_end is not None
    epochs = _EpochsOnly()
    step_end = Callbacks({"epochs": epochs}, 4).step_end
    for batches in range(1, 10):
        step_end(batches)
    assert epochs.ended == [0, 1]
    patched = dtrain.LoopCallback()
    patched.on_trial_shutdown = lambda: None  # an instance attribute counts as an override too
    assert len(Callbacks({"p": patched}, 4)._on["on_trial_shutdown"]) == 1
    assert not Callbacks({"c": _Counter()}, 4).wants_reports


def test_callbacks_and_their_state_are_checked_in_one_line():
    with pytest.raises(UserError, match=r"build_callbacks\(\) returned a list; return a dict"):
        Callbacks([_Counter()], 4)
    with pytest.raises(UserError, match=r"entry 'x' is a str; each must be a dtrain.LoopCallback"):
        Callbacks({"x": "not a callback"}, 4)

    class Holding(dtrain.LoopCallback):
        def __init__(self, value):
            self.value = value

        def state_dict(self):
            return {"history": [1, 2.5, {"t": torch.ones(2), "d": torch.float16}], "value": self.value}

    extra, rank_extra = {"batches": 3}, {}
    Callbacks({"ok": Holding(("a", None, b"x"))}, 4).save_into(extra, rank_extra)
    assert extra["callbacks"]["ok"]["value"] == ("a", None, b"x") and rank_extra["callbacks"] is extra["callbacks"]
    import numpy as np

    for bad, where, kind in ((np.float64(1.0), "['value']", "float64"), ({1, 2}, "['value']", "set"),
                             ([object()], "['value'][0]", "object")):
        expected = f"callback 'held': state_dict(){where} is a {kind}: checkpoints keep data only"
        with pytest.raises(UserError, match=re.escape(expected)):
            Callbacks({"held": Holding(bad)}, 4).save_into({"batches": 3}, {})
    unchanged = {"batches": 3}
    Callbacks({}, 4).save_into(unchanged, {})
    assert unchanged == {"batches": 3}  # no callbacks: checkpoints as before
