"""LR schedulers the Trial's loop steps (wrap_lr_scheduler's step_mode, as Determined's): when each mode
steps, exactly across a resume, and bad input in one line."""

from __future__ import annotations

import json

import pytest
import torch
from oneslot import one_slot_run

import dtrain
from dtrain.engine import schedulers
from dtrain.engine.schedulers import LRScheduler, StepMode
from dtrain.errors import UserError

# The tiny trial with a StepLR (gamma 0.5) wrapped as the hyperparameters say; it writes the learning rate
# each batch trains with to lrs.jsonl.
SCHEDULED = '''
import json

import torch
from tiny import TinyTrial


class ScheduledTrial(TinyTrial):
    def __init__(self, context):
        super().__init__(context)
        hp = self.hp
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=hp["step_size"], gamma=0.5)
        mode = {} if hp.get("step_mode") is None else {"step_mode": hp["step_mode"]}
        context.wrap_lr_scheduler(self.scheduler, **mode)

    def train_batch(self, batch, epoch_idx, batch_idx):
        with open(self.hp["out"], "a") as f:
            f.write(json.dumps([batch_idx, self.optimizer.param_groups[0]["lr"]]) + "\\n")
        metrics = super().train_batch(batch, epoch_idx, batch_idx)
        if self.hp.get("trial_steps"):
            self.scheduler.step()
        return metrics
'''
LR = 0.05  # the tiny trial's default


def _lrs(tmp_path, name="lrs.jsonl"):
    return [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]


def _run(tmp_path, run="run", batches=12, resume=False, **hparams):
    # 64 records, 16 per batch: 4 batches per epoch. Profiling off: its end-of-run probe calls train_batch.
    settings = {f"hyperparameters.{k}": v for k, v in {"out": str(tmp_path / "lrs.jsonl"), **hparams}.items()}
    return one_slot_run(tmp_path, SCHEDULED, "scheduled:ScheduledTrial", tmp_path / run, resume=resume,
                        **settings, max_length={"batches": batches}, scheduling_unit=4, **{"profiling.enabled": False})


def test_a_wrapped_scheduler_is_stepped_every_batch_by_default(tmp_path):
    warnings = _run(tmp_path, step_size=5)
    assert _lrs(tmp_path) == [[b, LR * 0.5 ** (b // 5)] for b in range(12)]
    assert not any("stepped by dtrain" in w for w in warnings), warnings


def test_every_epoch_and_manual_modes(tmp_path):
    _run(tmp_path, step_size=1, step_mode="step_every_epoch")
    assert _lrs(tmp_path) == [[b, LR * 0.5 ** (b // 4)] for b in range(12)]
    (tmp_path / "lrs.jsonl").unlink()
    _run(tmp_path, run="manual", step_size=1, step_mode="MANUAL_STEP")  # a name in any case
    assert _lrs(tmp_path) == [[b, LR] for b in range(12)]


def test_a_scheduler_stepped_by_the_trial_too_gets_one_warning(tmp_path):
    warnings = _run(tmp_path, step_size=1, trial_steps=True)
    assert [lr for _, lr in _lrs(tmp_path)] == [LR * 0.25 ** b for b in range(12)]  # twice per batch
    doubled = [w for w in warnings if "stepped by dtrain" in w]
    assert len(doubled) == 1 and "StepLR" in doubled[0] and "step_mode='manual_step'" in doubled[0], warnings


@pytest.mark.parametrize("mode", ["step_every_batch", "step_every_epoch"])
def test_resume_at_an_epoch_boundary_neither_repeats_nor_loses_a_step(tmp_path, mode):
    _run(tmp_path, run="whole", step_size=3, step_mode=mode)
    whole = _lrs(tmp_path)
    (tmp_path / "lrs.jsonl").unlink()
    _run(tmp_path, run="parts", batches=8, step_size=3, step_mode=mode)  # stops at the end of epoch 1
    _run(tmp_path, run="parts", batches=12, resume=True, step_size=3, step_mode=mode)
    assert _lrs(tmp_path) == whole
    # The schedulers' saved states (after the optimizer's in optimizer.pt) end where they would.
    saved = [torch.load(tmp_path / r / "checkpoints" / "12" / "optimizer.pt", weights_only=True)[-1]
             for r in ("whole", "parts")]
    assert saved[0]["last_epoch"] == saved[1]["last_epoch"] == (12 if mode == "step_every_batch" else 3)


class _Counting:
    """A scheduler that counts its steps (last_epoch, as torch's)."""

    def __init__(self):
        self.last_epoch = 0

    def step(self):
        self.last_epoch += 1

    def state_dict(self):
        return {"last_epoch": self.last_epoch}


def _steps(mode, k, f, epoch, total, resume_at=None):
    """Steps taken after each batch of a run of ``total`` batches, aggregation ``k``; restarted (a new
    stepper, as on resume) after batch ``resume_at``."""
    sched = _Counting()
    wrapped = [LRScheduler(sched, mode, f)]
    step = schedulers.stepper(wrapped, epoch, k, is_chief=False)
    out = []
    for b in range(1, total + 1):
        step(b, b % k == 0 or b == total)
        out.append(sched.last_epoch)
        if b == resume_at:
            step = schedulers.stepper(wrapped, epoch, k, is_chief=False)
    return out


def test_each_mode_steps_by_its_own_count_whatever_the_aggregation():
    epoch, total = 6, 26
    for k in (1, 2, 4):
        for f in (1, 2, 3):
            syncs = [b for b in range(1, total + 1) if b % k == 0 or b == total]
            every_batch = _steps(StepMode.STEP_EVERY_BATCH, k, f, epoch, total)
            optimizer = _steps(StepMode.STEP_EVERY_OPTIMIZER_STEP, k, f, epoch, total)
            for b in syncs:  # at each optimizer step: one per f batches trained, one per f optimizer steps
                assert every_batch[b - 1] == b // f, (k, f, b)
                assert optimizer[b - 1] == (syncs.index(b) + 1) // f, (k, f, b)
            by_epoch = _steps(StepMode.STEP_EVERY_EPOCH, k, f, epoch, total)
            if k == 1:  # at each epoch's last batch
                assert by_epoch == [b // epoch // f for b in range(1, total + 1)], f
            # Determined's rule: epoch e's step comes at the optimizer step after which the next one is in
            # epoch e + 1, so never later than the epoch's end and never before the group that reaches it.
            for b in syncs:
                ended = [e for e in range((b - 1 + k) // epoch) if (e + 1) % f == 0]
                assert by_epoch[b - 1] == len(ended), (k, f, b)
            assert schedulers.stepper([LRScheduler(_Counting(), StepMode.MANUAL_STEP)], epoch, k, False) is None
            for mode in (StepMode.STEP_EVERY_BATCH, StepMode.STEP_EVERY_OPTIMIZER_STEP, StepMode.STEP_EVERY_EPOCH):
                whole = _steps(mode, k, f, epoch, total)
                for at in syncs:  # a checkpoint (and a resume) can only be at an optimizer step
                    assert _steps(mode, k, f, epoch, total, resume_at=at) == whole, (mode, k, f, at)


def test_step_mode_input_is_checked_in_one_line():
    params = [torch.nn.Parameter(torch.zeros(1))]
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(params, lr=0.1), step_size=1)
    default = StepMode.STEP_EVERY_BATCH
    assert schedulers.parse_step_mode(None, default) is default
    assert schedulers.parse_step_mode("step_every_epoch", default) is StepMode.STEP_EVERY_EPOCH
    assert schedulers.parse_step_mode(LRScheduler.StepMode.MANUAL_STEP, default) is StepMode.MANUAL_STEP
    assert [m.name for m in StepMode] == ["STEP_EVERY_EPOCH", "STEP_EVERY_BATCH", "MANUAL_STEP",
                                          "STEP_EVERY_OPTIMIZER_STEP"]  # Determined's names and values
    for bad, words in (("every_batch", "step_mode must be one of"), (2, "step_mode must be one of")):
        with pytest.raises(UserError, match=words):
            schedulers.wrap(sched, bad, 1, default, has_loop=True)
    for frequency in (0, 1.5, True):
        with pytest.raises(UserError, match="frequency must be an integer >= 1"):
            schedulers.wrap(sched, None, frequency, default, has_loop=True)
    with pytest.raises(UserError, match="expected a torch LR scheduler"):
        schedulers.wrap(object(), None, 1, default, has_loop=True)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(UserError, match="ReduceLROnPlateau steps on a metric"):
        schedulers.wrap(plateau, None, 1, default, has_loop=True)
    assert schedulers.wrap(plateau, "manual_step", 1, default, has_loop=True).step_mode is StepMode.MANUAL_STEP


def test_the_own_loop_steps_its_schedulers_itself():
    ctx = dtrain.init(seed=0, quiet=True)
    try:
        model = torch.nn.Linear(2, 1)
        model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        assert ctx.wrap_lr_scheduler(sched) is sched  # manual by default: returned as it was given
        assert ctx.lr_wrapped[-1].step_mode is StepMode.MANUAL_STEP
        with pytest.raises(UserError, match="needs dtrain's Trial loop"):
            ctx.wrap_lr_scheduler(sched, step_mode="step_every_batch")
        with pytest.raises(UserError, match="step_mode must be one of"):
            ctx.wrap_lr_scheduler(sched, step_mode="sometimes")
    finally:
        ctx.close()
