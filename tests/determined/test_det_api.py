"""dtrain.determined in this process: the API surface, its one-line refusals, and the Trainer API on one slot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import TRIALS, cli_in_process, final_weights, write

import dtrain.determined as det
from dtrain.determined import pytorch
from dtrain.engine.callbacks import Callbacks
from dtrain.errors import UserError

SETTINGS = {"hparams": {"global_batch_size": 16, "hidden": 16, "lr": 0.05, "out": "."},
            "exp_conf": {"seed": 3, "profiling": {"enabled": False}, "data": {"train_size": 64},
                         "environment": {"image": "determinedai/pytorch"}, "searcher": {"name": "single"}}}


@pytest.fixture
def det_mlp(tmp_path, monkeypatch):
    """The Determined-style trial's module, imported from a copy in tmp_path (its checkpoint notes land there)."""
    shutil.copy(TRIALS / "determined_mlp.py", tmp_path / "determined_mlp.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    import importlib

    import determined_mlp

    return importlib.reload(determined_mlp)


def _one_line(exc: pytest.ExceptionInfo, *words: str) -> None:
    text = str(exc.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_top_level_names_and_what_is_not_here():
    assert det.get_cluster_info() is None and det.pytorch is pytorch
    assert "%(levelname)s" in det.LOG_FORMAT and issubclass(det.InvalidHP, UserError)
    assert pytorch.LRScheduler.StepMode is __import__("dtrain").StepMode  # dtrain's enum, as asked
    for used in (lambda: det.keras, lambda: det.core.init(), lambda: det.experimental.client,
                 lambda: pytorch.deepspeed, lambda: pytorch.load_trial_from_checkpoint_path):
        with pytest.raises(det.NotHere) as exc:
            used()
        _one_line(exc, "is not available in dtrain")
    assert not hasattr(det, "keras") and not hasattr(det.core, "_private")  # absent, not an error
    dist = det.core.DistributedContext.from_torch_distributed()
    assert (dist.get_rank(), dist.get_size(), dist.get_cross_size()) == (0, 1, 1)
    assert dist.broadcast({"a": 1}) == {"a": 1} and dist.allgather(3) == [3] and dist.gather(4) == [4]
    assert pytorch.Batch(3).to_length("x") == {"batches": 3} and pytorch.Epoch(2).to_length("x") == {"epochs": 2}
    with pytest.raises(UserError) as exc:
        pytorch.Batch([5, 30]).to_length("validation_period")
    _one_line(exc, "validation_period", "whole number")


def test_data_loader_keeps_torch_options_and_refuses_what_dtrain_owns():
    data = torch.utils.data.TensorDataset(torch.zeros(10, 2))
    loader = pytorch.DataLoader(data, batch_size=4, num_workers=2, collate_fn=list, drop_last=True, timeout=5)
    assert loader.options("train") == {"collate_fn": list, "num_workers": 2, "timeout": 5}
    assert loader.options("eval")["drop_last"] is True
    assert pytorch.DataLoader(data, batch_size=4).options("train") == {}  # num_workers stays the config's
    for kwargs, words in (({"sampler": [0]}, "drop sampler="), ({"batch_size": 0}, "per-slot batch size"),
                          ({"prefetch_factor": 2}, "num_workers >= 1")):
        with pytest.raises(UserError) as exc:
            pytorch.DataLoader(data, **{"batch_size": 4, **kwargs})
        _one_line(exc, words)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(())

    with pytest.raises(UserError, match="IterableDataset"):
        pytorch.DataLoader(Stream(), batch_size=2)
    assert pytorch.data_length((torch.zeros(5, 3), torch.zeros(5))) == 5


def test_evaluate_batch_with_or_without_batch_idx_and_exactly_one_way_to_validate():
    class Base(pytorch.PyTorchTrial):
        def train_batch(self, batch, epoch_idx, batch_idx):
            return {}

        def build_training_data_loader(self):
            return None

        def build_validation_data_loader(self):
            return None

    class One(Base):
        def evaluate_batch(self, batch):
            return {"seen": batch}

    class Two(Base):
        def evaluate_batch(self, batch, batch_idx):
            return {"seen": (batch, batch_idx)}

    class Named(Base):
        def evaluate_batch(self, batch, *, batch_idx):
            return {"seen": (batch, batch_idx)}

    class Child(One):  # inherits the adapted one-argument form
        pass

    assert One.evaluate_batch(None, "b", 7) == {"seen": "b"} and Child.evaluate_batch(None, "b", 7) == {"seen": "b"}
    assert One.evaluate_batch(None, "b") == {"seen": "b"}  # the trial's own one-argument calls still work
    assert Two.evaluate_batch(None, "b", 7) == {"seen": ("b", 7)}
    assert Named.evaluate_batch is Named.__dict__["evaluate_batch"]

    class Both(One):
        def evaluate_full_dataset(self, data_loader):
            return {}

    for cls, words in ((Base, "define exactly one of"), (Both, "it defines both")):
        trial = object.__new__(cls)
        with pytest.raises(UserError) as exc:
            cls.build_validation_data(trial)
        _one_line(exc, words)


def test_callbacks_keep_determineds_ranks_and_names(monkeypatch):
    calls = []

    class Cb(pytorch.PyTorchCallback):
        def on_checkpoint_end(self, checkpoint_dir):
            calls.append(("end", checkpoint_dir))

        def on_checkpoint_write_end(self, checkpoint_dir):
            calls.append(("write", checkpoint_dir))

        def on_checkpoint_upload_end(self, uuid):
            calls.append(("upload", uuid))

        def on_training_workload_end(self, avg_metrics, batch_metrics):
            calls.append(("workload", avg_metrics, batch_metrics))

    class Grandchild(Cb):  # its parent's hooks, composed the same way
        pass

    callbacks = Callbacks({"cb": Cb(), "gc": Grandchild()}, batches_per_epoch=4)
    assert callbacks.step_end is None  # nothing per step: no per-step hook overridden
    callbacks.on_checkpoint_write_end("ckpt/8")
    callbacks.on_training_report(8, {"loss": 0.5})
    assert calls == [("end", "ckpt/8"), ("write", "ckpt/8"), ("upload", "ckpt/8")] * 2 + \
        [("workload", {"loss": 0.5}, [])] * 2
    calls.clear()
    from dtrain.determined.pytorch import _callback

    monkeypatch.setattr(_callback, "_is_chief", lambda: False)
    callbacks.on_checkpoint_write_end("ckpt/9")
    assert calls == [("upload", "ckpt/9")] * 2  # write_end (and the old end) on the chief only, as in Determined
    with pytest.raises(UserError) as exc:
        type("Old", (pytorch.PyTorchCallback,), {"on_validation_epoch_end": lambda self, outputs: None})
    _one_line(exc, "on_validation_end")


def test_trainer_api_on_one_slot_resumes_exactly_in_a_named_run_directory(det_mlp, tmp_path):
    def fit(run_dir, batches, **kwargs):
        with pytorch.init(run_dir=run_dir, **SETTINGS) as context:
            trial = det_mlp.DetMLP(context)
            assert context.get_data_config() == {"train_size": 64}
            assert context.get_experiment_config()["searcher"] == {"name": "single"}
            assert context.distributed.get_size() == 1 and isinstance(context, pytorch.PyTorchTrialContext)
            summary = pytorch.Trainer(trial, context).fit(max_length=pytorch.Batch(batches), **kwargs)
            return summary, trial

    periods = {"validation_period": pytorch.Batch(4), "checkpoint_period": pytorch.Batch(4),
               "reporting_period": pytorch.Batch(4)}
    straight, trial = fit(tmp_path / "straight", 12, **periods)
    assert straight["batches"] == 12 and trial.counter.state_dict() == {"epochs": 3, "validations": 3}
    fit(tmp_path / "split", 8, **periods)  # ends where a period does: the same reports and checkpoints
    resumed, trial = fit(tmp_path / "split", 12, **periods)  # a run directory named again: continued
    assert resumed["resumed_at_batch"] == 8 and trial.counter.state_dict() == {"epochs": 3, "validations": 3}
    for run in ("straight", "split"):
        assert (tmp_path / run / "config.yaml").exists()
    a, b = (final_weights(tmp_path / r) for r in ("straight", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)

    def records(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [(r["kind"], r["batches"], r["metrics"]) for r in map(json.loads, lines)]

    assert records("straight") == records("split")  # callback state and scheduler restored with the weights
    assert (tmp_path / "written.rank0").read_text().split() == ["4", "8", "12"] * 2


def test_batch_size_must_be_the_per_slot_batch_and_the_loader_determineds(det_mlp, tmp_path):
    class Wrong(det_mlp.DetMLP):
        def build_training_data_loader(self):
            return pytorch.DataLoader(det_mlp.synthetic(64, 1), batch_size=32)

    class Bare(det_mlp.DetMLP):
        def build_training_data_loader(self):
            return torch.utils.data.DataLoader(det_mlp.synthetic(64, 1), batch_size=8)

    for cls, words in ((Wrong, ("batch_size is 32 but the per-slot batch size is 16", "get_per_slot_batch_size()")),
                       (Bare, ("returned a torch DataLoader", "pytorch.DataLoader(dataset"))):
        with pytest.raises(UserError) as exc, pytorch.init(run_dir=tmp_path / cls.__name__, **SETTINGS) as context:
            pytorch.Trainer(cls(context), context).fit(max_length=pytorch.Batch(2))
        _one_line(exc, *words)


def test_without_global_batch_size_the_loader_sets_it(det_mlp, tmp_path):
    settings = {**SETTINGS, "hparams": {"hidden": 16, "lr": 0.05}}

    class OwnBatch(det_mlp.DetMLP):
        def build_training_data_loader(self):
            return pytorch.DataLoader(det_mlp.synthetic(64, 1), batch_size=8)

        def build_validation_data_loader(self):
            return pytorch.DataLoader(det_mlp.synthetic(61, 2), batch_size=8)

    with pytorch.init(run_dir=tmp_path / "r", **settings) as context:
        with pytest.raises(UserError, match="no global_batch_size"):
            context.get_per_slot_batch_size()
        summary = pytorch.Trainer(OwnBatch(context), context).fit(max_length=pytorch.Epoch(1))
        assert context.get_global_batch_size() == 8 and summary["batches"] == 8  # 64 records / 8


def test_context_refusals_are_one_line(det_mlp, tmp_path):
    with pytorch.init(run_dir=tmp_path / "r", **SETTINGS) as context:
        trial = det_mlp.DetMLP(context)
        for call, words in ((lambda: context.wrap_scaler(object()), "precision: 16-mixed"),
                            (lambda: context.step_optimizer(trial.optimizer, scaler=object()), "precision"),
                            (lambda: context.get_experiment_id(), "no Determined master"),
                            (lambda: context.wrap_reducer(lambda x: x), "record-weighted"),
                            (lambda: context.wrap_lr_scheduler(torch.optim.lr_scheduler.StepLR(
                                torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), 1), "step_every_epoch"),
                             "wrap_optimizer did not return")):
            with pytest.raises(UserError) as exc:
                call()
            _one_line(exc, words)
        assert context.get_trial_seed() == 3 and context.get_tensorboard_path() == tmp_path / "r" / "tensorboard"
        context.set_stop_requested(True)
        assert context.get_stop_requested()
        context.set_stop_requested(False)
        assert not context.get_stop_requested()


def test_dtrain_check_builds_a_determined_trial(tmp_path):
    shutil.copy(TRIALS / "determined_mlp.py", tmp_path / "determined_mlp.py")
    cfg = write(tmp_path / "experiment.yaml", """
        name: det
        entrypoint: determined_mlp:DetMLP
        hyperparameters: {global_batch_size: 16}
        resources: {slots_per_trial: 2}
        backend: gloo
        max_length: {epochs: 2}
    """)
    result = cli_in_process("check", str(cfg))
    assert result.code == 0, result.stderr
    assert "128" in result.stdout  # the data's size, as each worker would build it
    write(tmp_path / "wrong.py", """
        from determined_mlp import DetMLP, synthetic
        from dtrain.determined import pytorch

        class Wrong(DetMLP):
            def build_training_data_loader(self):
                return pytorch.DataLoader(synthetic(128, 1), batch_size=16)  # the global batch, not per slot
    """)
    wrong = write(tmp_path / "wrong.yaml", Path(cfg).read_text().replace("determined_mlp:DetMLP", "wrong:Wrong"))
    result = cli_in_process("check", str(wrong))
    assert result.code == 2 and "batch_size is 16 but the per-slot batch size is 8" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_trial_that_asks_to_stop_ends_its_fit_with_a_checkpoint(det_mlp, tmp_path):
    class Early(det_mlp.DetMLP):
        def train_batch(self, batch, epoch_idx, batch_idx):
            if batch_idx == 7:
                assert self.context.current_train_batch() == 7 and self.context.current_train_epoch() == 1
                assert self.context.is_epoch_end() and not self.context.is_epoch_start()  # 4 batches an epoch
                self.context.set_stop_requested(True)
            return super().train_batch(batch, epoch_idx, batch_idx)

    with pytorch.init(run_dir=tmp_path / "r", **SETTINGS) as context:
        summary = pytorch.Trainer(Early(context), context).fit(max_length=pytorch.Batch(12))
        assert summary == {"stopped_at": 8} and not context.get_stop_requested()  # the request ends with its fit
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text().strip() == "8"


def test_clip_grads_manual_zeroing_collate_fn_and_a_bare_loss(det_mlp, tmp_path):
    from torch.utils.data import default_collate

    class Manual(det_mlp.DetMLP):
        clipped = collated = 0

        def build_training_data_loader(self):
            return pytorch.DataLoader(det_mlp.synthetic(64, 1), batch_size=self.context.get_per_slot_batch_size(),
                                      collate_fn=self.collate)

        def collate(self, samples):
            self.collated += 1
            return default_collate(samples)

        def clip(self, params):
            self.clipped += 1
            assert len(params) == 4  # the optimizer's parameters, as Determined passes them
            torch.nn.utils.clip_grad_norm_(params, 1.0)

        def train_batch(self, batch, epoch_idx, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            self.context.backward(loss)
            self.context.step_optimizer(self.optimizer, clip_grads=self.clip, auto_zero_grads=False)
            assert all(p.grad is not None for p in self.model.parameters())  # left to the trial
            self.optimizer.zero_grad()
            return loss  # a bare loss: reported as "loss"

    with pytorch.init(run_dir=tmp_path / "r", **SETTINGS) as context:
        trial = Manual(context)
        pytorch.Trainer(trial, context).fit(max_length=pytorch.Batch(4), reporting_period=pytorch.Batch(4))
        assert trial.clipped == 4 and trial.collated >= 4 and context.zero_grads
    report = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert report["kind"] == "training" and set(report["metrics"]) == {"loss"}
