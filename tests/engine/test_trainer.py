"""End to end through `dtrain run`: the sacred invariant and exact validation."""

import json

import pytest
import torch
from helpers import final_weights, tiny_config, train
from trials.tiny import TinyTrial, synthetic  # noqa: F401  (importable on its own)


def _run(tmp_path, name, *args, **overrides):
    cfg = tiny_config(tmp_path, **overrides)
    return tmp_path / name, train(cfg, tmp_path / name, *args)


@pytest.mark.slow
def test_one_slot_and_two_slots_give_the_same_weights(reference_runs):
    w1, w2 = reference_runs.weights(1), reference_runs.weights(2)
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-6)
    summary = json.loads((reference_runs.run_dir(2) / "summary.json").read_text())
    assert summary["slots"] == 2 and summary["per_slot_batch_size"] == 8 and summary["batches"] == 24
    assert summary["samples_per_second"] > 0


@pytest.mark.slow
def test_run_directory_layout_and_validation_is_exact(tmp_path):
    run_dir, _ = _run(tmp_path, "run", **{"min_validation_period": {"batches": 12},
                                          "optimizations.average_training_metrics": False})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [(r["kind"], r["batches"]) for r in records]
    assert kinds == [("training", 8), ("validation", 12), ("training", 16), ("training", 24), ("validation", 24)]
    for r in records:
        assert set(r) >= {"kind", "batches", "epoch", "metrics"}
    # Validation on 2 uneven shards (61 records) equals one process over the whole set.
    trial_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.0),
                                      torch.nn.Linear(16, 1))
    trial_model.load_state_dict(final_weights(run_dir))
    x, y = synthetic(61, seed=2).tensors
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(trial_model(x), y).item()
    assert abs(records[-1]["metrics"]["mse"] - expected) < 1e-6
    assert (run_dir / "config.yaml").exists() and (run_dir / "logs" / "rank1.log").exists()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_reads_every_scalar_of_a_report(tmp_path):
    """A report's scalars are written as one event: TensorBoard must still see one series per tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dtrain.engine.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path)
    writer.write("training", 100, 0, {"loss": 0.5, "acc": 0.25}, samples_per_second=10.0)
    writer.scalars("time_ms", {"forward": 1.5, "backward": 3.0}, 100)
    writer.write("training", 200, 0, {"loss": 0.25, "acc": 0.5})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()  # before close: each report is flushed as it is written
    assert sorted(events.Tags()["scalars"]) == ["time_ms/backward", "time_ms/forward", "training/acc", "training/loss"]
    assert [(e.step, e.value) for e in events.Scalars("training/loss")] == [(100, 0.5), (200, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("time_ms/backward")] == [(100, 3.0)]
    writer.close()


def test_train_batch_metrics_are_checked_with_a_one_line_error():
    from dtrain.engine.metrics import MeanAccumulator, checked_metrics
    from dtrain.errors import UserError

    checked = checked_metrics({"loss": torch.tensor(0.25, requires_grad=True), "acc": 1})
    assert checked == {"loss": 0.25, "acc": 1.0}  # CPU tensors read once, on the host
    acc = MeanAccumulator()
    acc.add_checked(checked)
    acc.add({"loss": 0.75, "acc": 0.0})
    assert acc.local_means() == {"loss": 0.5, "acc": 0.5}
    for bad, words in ((None, "returned a NoneType"), ({"loss": torch.ones(2)}, r"shape \(2,\)"),
                       ({"loss": "low"}, "is a str")):
        with pytest.raises(UserError, match=words):
            checked_metrics(bad)


def _reference_schedule(start, total, k, val_every, ckpt_every):
    """The rule as documented: exchange at the end of each group of k and at the end; validate or checkpoint
    at an exchange when a multiple of the period lies after the previous exchange."""
    previous = start
    for b in range(start + 1, total + 1):
        sync = b % k == 0 or b == total
        def crossed(period, b=b, previous=previous):
            return bool(period) and b // period > previous // period
        yield b, sync, sync and crossed(val_every), sync and crossed(ckpt_every)
        previous = b if sync else previous


def test_the_schedule_validates_and_checkpoints_at_the_first_exchange_past_each_period():
    from types import SimpleNamespace

    from dtrain.engine.trainer import Trainer

    for k in (1, 2, 3):
        for val_every in (None, 1, 3, 7):
            for ckpt_every in (None, 2, 5):
                for start in (0, 4, 5):
                    for total in (12, 13):
                        trainer = SimpleNamespace(ctx=SimpleNamespace(aggregation_frequency=k), total_batches=total,
                                                  batches=start, val_every=val_every, ckpt_every=ckpt_every)
                        expected = list(_reference_schedule(start, total, k, val_every, ckpt_every))
                        assert list(Trainer.schedule(trainer)) == expected, (k, val_every, ckpt_every, start)


# Synthetic data (issue 34): every step gets the one batch, read once in the rank, and the loader is never
# iterated. A loader iterator per epoch, as for real data, kept ``num_workers`` processes alive through every
# epoch, loading batches nobody read beside the training (2 slots x 2 workers on 2 cores: synthetic steps
# 0.74x as fast as without loader workers, and 10 s more per run at its end); the data-loading bisection of
# `dtrain doctor --verify` measured them.
SYNTHETIC_PROBE = '''
import json
import multiprocessing

from torch.utils.data import Dataset

from tiny import TinyTrial


class Counted(Dataset):
    """The tiny data set; every record read appends a byte to a file, in loader workers too."""

    def __init__(self, data, path):
        self.data, self.path = data, path

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        with open(self.path, "a") as f:
            f.write(".")
        return self.data[i]


class SyntheticProbe(TinyTrial):
    def build_training_data(self):
        return Counted(super().build_training_data(), self.hp["out"] + "/reads")

    def train_batch(self, batch, epoch_idx, batch_idx):
        reads = len(open(self.hp["out"] + "/reads").read())
        seen = [epoch_idx, batch[0].data_ptr(), len(multiprocessing.active_children()), self.context.rollcall.epoch,
                reads]
        with open(self.hp["out"] + "/steps.jsonl", "a") as f:
            f.write(json.dumps(seen) + "\\n")
        return super().train_batch(batch, epoch_idx, batch_idx)
'''


def test_synthetic_data_reads_one_batch_and_starts_no_loader_worker(tmp_path):
    import multiprocessing

    from dtrain import dist as ddist
    from dtrain.config.schema import load_config
    from dtrain.engine.trainer import run_trial

    # 1 slot, 64 records, 16 per batch: 4 batches per epoch, 12 batches = 3 epochs; one loader worker.
    cfg = tiny_config(tmp_path, **{"entrypoint": "probe:SyntheticProbe", "resources.slots_per_trial": 1,
                                   "hyperparameters.train_size": 64, "hyperparameters.val_size": 0,
                                   "hyperparameters.out": str(tmp_path), "max_length": {"batches": 12},
                                   "scheduling_unit": 12, "data_loader": {"synthetic": True, "num_workers": 1},
                                   "profiling.enabled": False})
    (tmp_path / "probe.py").write_text(SYNTHETIC_PROBE)
    (tmp_path / "run" / "logs").mkdir(parents=True)
    children = len(multiprocessing.active_children())
    try:  # in this process: a world of one
        run_trial(load_config(cfg), tmp_path / "run", None, quiet=True)
    finally:
        ddist.destroy_process_group()
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s[0] for s in steps] == [0] * 4 + [1] * 4 + [2] * 4
    assert len({s[1] for s in steps}) == 1  # the same batch, not a copy, every step
    assert [s[2] for s in steps] == [children] * 12  # no loader worker alive during any step
    assert [s[3] for s in steps] == [s[0] for s in steps]  # each epoch still announced (the roll call)
    assert steps[-1][4] == 16  # the batch kept, read in the rank itself: no worker started, nothing ahead


def _epoch_starts(rank, world, config, run_dir):
    """Whether a timed step was open each time an epoch's iterator was started."""
    from pathlib import Path

    from dtrain.config.schema import load_config
    from dtrain.engine import data
    from dtrain.engine.trainer import run_trial
    from dtrain.profiling.timer import StepTimer

    inside, seen = [False], []
    start_step, end_step, feeder_start = StepTimer.start_step, StepTimer.end_step, data.DeviceFeeder.start

    def opened(self):
        inside[0] = True
        start_step(self)

    def closed(self):
        inside[0] = False
        end_step(self)

    def started(self, iterator):
        seen.append(inside[0])
        feeder_start(self, iterator)

    StepTimer.start_step, StepTimer.end_step, data.DeviceFeeder.start = opened, closed, started
    (Path(run_dir) / "logs").mkdir(parents=True)
    run_trial(load_config(config), Path(run_dir), None, quiet=True)
    return seen


def test_the_first_batch_of_each_epoch_is_loaded_inside_its_step(tmp_path):
    # On CUDA the feeder loads and copies an epoch's first batch when it starts: time the step waits for data.
    from helpers import run_ranks

    cfg = tiny_config(tmp_path, **{"resources.slots_per_trial": 1, "hyperparameters.train_size": 64,
                                   "max_length": {"batches": 12}})  # 4 batches an epoch: 3 epochs
    seen = run_ranks(_epoch_starts, world_size=1, timeout=90, args=(str(cfg), str(tmp_path / "r")))[0]
    assert seen == [True, True, True]
