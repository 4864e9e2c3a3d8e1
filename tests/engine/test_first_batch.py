"""What the loop checks after the first batch: a train_batch written the torchrun way (loss.backward();
opt.step()) and hyperparameters set but never read, each one warning line; the profile records the phases not
seen, and the doctor does not diagnose them."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import yaml
from oneslot import one_slot_run

from dtrain.engine.hparams import HparamReads, suggest
from dtrain.errors import UserError
from dtrain.explain.doctor import diagnose
from dtrain.explain.summary import time_cost_table
from dtrain.profiling.record import load_profile

# The tiny trial as a torchrun user writes it first: the plain autograd and optimizer calls. It counts its
# train_batch calls, so that the end-of-run probe (which would step this optimizer) is seen to stay away.
RAW = '''
from pathlib import Path

from torch import nn
from tiny import TinyTrial


class RawTrial(TinyTrial):
    def train_batch(self, batch, epoch_idx, batch_idx):
        with Path(self.hp["out"]).open("a") as f:
            f.write(".")
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"loss": loss}
'''


def test_a_torchrun_style_trial_is_named_and_not_diagnosed(tmp_path):
    out = tmp_path / "calls"
    warnings = one_slot_run(tmp_path, RAW, "raw:RawTrial", tmp_path / "run", max_length={"batches": 12},
                            scheduling_unit=12, **{"hyperparameters.out": str(out),
                                                   "hyperparameters.learning_rate": 0.01})
    phases = [w for w in warnings if "train_batch did not call" in w]
    assert len(phases) == 1, warnings
    assert ("call self.context.backward(loss) and self.context.step_optimizer(opt) instead of loss.backward() / "
            "opt.step()") in phases[0]
    assert "aggregation_frequency, 16-mixed loss scaling, on_nonfinite" in phases[0]
    hparams = [w for w in warnings if w.startswith("hyperparameters set but never read")]
    assert hparams == ["hyperparameters set but never read by the trial: learning_rate (did you mean lr?); they "
                       "change nothing (no rank read them during the run)"], warnings
    assert len(out.read_text()) == 12  # the trained batches only: no end-of-run probe stepped its optimizer

    profile = load_profile(tmp_path / "run" / "profile.json")
    assert profile.unobserved_phases == ["forward", "backward", "comm_exposed", "optimizer"]
    assert profile.batch_scaling is None and profile.solo_probe is None
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["unobserved_phases"] == \
        profile.unobserved_phases
    diagnosis = diagnose(profile).to_json()
    assert not diagnosis["phases_observed"] and diagnosis["top_factor"] is None
    assert diagnosis["verdict"].startswith("the step's phases were not observed: train_batch calls "
                                           "loss.backward() / opt.step() itself")
    assert "\n" not in diagnosis["verdict"]
    assert diagnosis["recommendations"] == []
    assert all(f["key"] is None and f["predicted_speedup"] is None for f in diagnosis["factors"])
    assert {f["factor"] for f in diagnosis["factors"]} == {"data_loading", "train_batch"}
    assert abs(sum(f["seconds_per_step"] for f in diagnosis["factors"]) - diagnosis["step_seconds"]) < 1e-12
    table = time_cost_table(profile)
    assert "other*" in table and "forward" not in table.split("* other includes")[0]
    assert "* other includes forward, backward, comm_exposed, optimizer: not observed" in table


def test_a_trial_that_calls_both_is_diagnosed_and_not_warned(tmp_path):
    warnings = one_slot_run(tmp_path, "from tiny import TinyTrial\n", "plain:TinyTrial", tmp_path / "run",
                            max_length={"batches": 6}, scheduling_unit=6)
    assert not [w for w in warnings if "train_batch did not call" in w or "never read" in w], warnings
    profile = load_profile(tmp_path / "run" / "profile.json")
    assert profile.unobserved_phases is None and profile.phases_observed
    assert "unobserved_phases" not in json.loads((tmp_path / "run" / "profile.json").read_text())
    assert diagnose(profile).phases_observed


def test_only_the_optimizer_step_unobserved_is_named_alone():
    from types import SimpleNamespace

    from dtrain.engine.firstbatch import check_first_batch, phases_warning, unobserved_phases
    from dtrain.errors import UserError

    ddp = SimpleNamespace(exchanges_in_step=False, name="ddp", dp_world=2)
    ctx = SimpleNamespace(backward_calls=1, step_optimizer_calls=0, strategy=ddp)
    assert unobserved_phases(ctx) == ["optimizer"]
    line = phases_warning(ctx)
    assert "did not call self.context.step_optimizer(opt) in its first batch" in line and "backward(loss)" not in line
    ctx.strategy = SimpleNamespace(exchanges_in_step=True, name="allreduce", dp_world=2)
    assert unobserved_phases(ctx) == ["comm_exposed", "optimizer"]
    with pytest.raises(UserError, match=r"sync.strategy allreduce exchanges the gradients there, so the slots would "
                                        r"train apart"):
        check_first_batch(ctx)  # the slots would diverge: refused, not a warning
    ctx.step_optimizer_calls = 1
    assert unobserved_phases(ctx) == [] and phases_warning(ctx) is None


def test_hyperparameter_reads_are_tracked_through_every_way_of_reading():
    config = {"global_batch_size": 16, "lr": 0.1, "learning_rate": 0.01, "hidden": 8,
              "optimizer": {"momentum": 0.9, "nesterov": True}}
    reads = HparamReads(config)
    assert reads.get_hparam("lr") == 0.1
    assert reads.unread() == ["learning_rate", "hidden", "optimizer"]  # dtrain reads global_batch_size itself
    hp = reads.get_hparams()
    assert "hidden" in hp and list(hp) == list(config) and reads.unread() == ["learning_rate", "hidden",
                                                                              "optimizer"]  # names only
    assert hp.get("hidden") == 8 and hp["optimizer"]["momentum"] == 0.9
    assert reads.unread() == ["learning_rate", "optimizer.nesterov"]
    assert reads.warning() == ("hyperparameters set but never read by the trial: learning_rate (did you mean lr?), "
                               "optimizer.nesterov; they change nothing (no rank read them during the run)")
    for read_all in (lambda h: list(h.items()), lambda h: list(h.values()), lambda h: h.copy(), json.dumps,
                     pickle.dumps, copy.deepcopy, yaml.safe_dump):
        again = HparamReads(config)
        read_all(again.get_hparams())
        assert again.unread() == [], again.unread()
    for copied in (dict, lambda h: {**h}, lambda h: (lambda **kw: kw)(**h)):
        again = HparamReads(config)
        value = copied(again.get_hparams())
        # Every top-level key read; the nested mapping, copied as it is, counts its keys as they are read.
        assert again.unread() == ["optimizer.momentum", "optimizer.nesterov"]
        assert dict(**value["optimizer"]) == config["optimizer"] and again.unread() == []
    assert type(copy.deepcopy(hp)) is dict and type(pickle.loads(pickle.dumps(hp))["optimizer"]) is dict
    assert yaml.safe_load(yaml.safe_dump(hp)) == config
    hp["lr"] = 1.0  # the trial's own copy
    assert reads.get_hparam("lr") == 0.1
    with pytest.raises(UserError, match=r"hyperparameter 'lrr' is not in the config \(have: global_batch_size, "):
        reads.get_hparam("lrr")
    assert HparamReads({"global_batch_size": 8}).warning() is None


def test_did_you_mean_finds_spellings_and_initials_among_the_names_read():
    read = {"lr", "hidden_size", "weight_decay", "model.depth"}
    assert suggest("learning_rate", read) == "lr"
    assert suggest("hiden_size", read) == "hidden_size"
    assert suggest("wd", read) == "weight_decay"
    assert suggest("model.dept", read) == "model.depth"
    assert suggest("depth", read) is None  # another nesting level
    assert suggest("batch_norm", read) is None


def _reads_on_two_ranks(rank, world):
    from types import SimpleNamespace

    import dtrain
    from dtrain.engine.firstbatch import _merge_reads

    ctx = dtrain.init(quiet=True)
    reads = HparamReads({"global_batch_size": 4, "lr": 0.1, "sleep_seconds": 1.0, "learning_rate": 0.01})
    reads.get_hparam("lr")
    if rank == 1:  # read on one rank only, as a trial's rank-specific code does
        reads.get_hparam("sleep_seconds")
    _merge_reads(SimpleNamespace(strategy=SimpleNamespace(dp_group=None), hparam_reads=reads))
    ctx.close()
    return reads.unread()


@pytest.mark.slow
def test_a_hyperparameter_read_on_one_rank_only_is_read():
    from helpers import run_ranks

    assert run_ranks(_reads_on_two_ranks, world_size=2) == [["learning_rate"], ["learning_rate"]]
