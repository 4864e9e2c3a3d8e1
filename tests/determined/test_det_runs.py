"""A Determined-style trial on several slots: `dtrain run` (1 vs 2 slots, crash and exact resume) and the
Trainer API under `dtrain launch`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import TRIALS, cli_in_process, final_weights, train
from torch import nn
from trials.determined_mlp import synthetic

from dtrain.config.schema import ExperimentConfig

HPARAMS = {"global_batch_size": 16, "hidden": 16, "lr": 0.05}
# 128 records, 16 a batch: 8 batches an epoch, 3 epochs (the scheduler steps at each epoch's end).
CONFIG = {"name": "det", "entrypoint": "determined_mlp:DetMLP", "hyperparameters": HPARAMS,
          "resources": {"slots_per_trial": 2, "collective_timeout_seconds": 30}, "backend": "gloo",
          "max_length": {"batches": 24}, "min_checkpoint_period": {"batches": 8},
          "min_validation_period": {"batches": 8}, "scheduling_unit": 8, "seed": 3, "profiling": {"enabled": False}}
if "data" in ExperimentConfig.model_fields:  # the config's data: section, once the schema has it
    CONFIG["data"] = {"train_size": 128}


def det_config(folder: Path, **hparams: object) -> Path:
    shutil.copy(TRIALS / "determined_mlp.py", folder / "determined_mlp.py")
    cfg = {**CONFIG, "hyperparameters": {**HPARAMS, "out": str(folder), **hparams}}
    path = folder / "experiment.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def records(run_dir: Path) -> list[tuple]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["kind"], r["batches"], r["metrics"]) for r in map(json.loads, lines)]


class Runs:
    """The trial's straight runs on 1 and 2 slots, trained once for the module."""

    def __init__(self, root: Path) -> None:
        self.root, self.dirs = root, {}

    def __call__(self, slots: int) -> Path:
        if slots not in self.dirs:
            folder = self.root / f"slots{slots}"
            folder.mkdir()
            train(det_config(folder), folder / "run", "--slots", str(slots))
            self.dirs[slots] = folder / "run"
        return self.dirs[slots]


@pytest.fixture(scope="module")
def det_runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("det"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_slots_train_as_one(det_runs):
    one, two = final_weights(det_runs(1)), final_weights(det_runs(2))
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)
    validations = [r for r in records(det_runs(2)) if r[0] == "validation"]
    assert [r[1] for r in validations] == [8, 16, 24]
    trained = [r[2] for r in records(det_runs(2)) if r[0] == "training"]
    assert [t["epochs_counted"] for t in trained] == [0, 1, 2]  # the callback's epochs, per report
    assert [round(t["lr"], 6) for t in trained] == [0.05, 0.035, 0.0245]  # StepLR stepped once an epoch
    folder = det_runs(2).parent
    assert (folder / "written.rank0").read_text().split() == ["8", "16", "24"]  # on the chief only
    assert not (folder / "written.rank1").exists()
    assert (folder / "uploaded.rank1").read_text().split() == ["8", "16", "24"]  # on every rank


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_crash_and_resume_is_exact(det_runs, tmp_path):
    cfg = det_config(tmp_path, die_at_batch=19)  # rank 1 dies after the checkpoint at batch 16
    crashed = train(cfg, tmp_path / "crashed", "--slots", "2", ok=False)
    assert crashed.code == 1 and "worker rank 1 failed" in crashed.stderr, crashed.stderr
    resumed = cli_in_process("run", "--resume", str(tmp_path / "crashed"), "--quiet",
                             "--set", "hyperparameters.die_at_batch=null")
    assert resumed.code == 0, resumed.stderr
    a, b = final_weights(det_runs(2)), final_weights(tmp_path / "crashed")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # The callback's counts and the scheduler's rate came back with the weights: every report is the same.
    assert records(tmp_path / "crashed") == records(det_runs(2))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_trainer_api_under_dtrain_launch_trains_as_dtrain_run(det_runs, tmp_path, monkeypatch):
    shutil.copy(TRIALS / "determined_mlp.py", tmp_path / "determined_mlp.py")
    exp_conf = {key: CONFIG[key] for key in ("name", "seed", "backend", "profiling", "resources")}
    exp_conf["data"] = {"train_size": 128}
    exp_conf["environment"] = {"image": "determinedai/pytorch-ngc"}  # Determined's: ignored here, one line
    settings = {"hparams": {**HPARAMS, "out": str(tmp_path)}, "exp_conf": exp_conf, "batches": 24}
    monkeypatch.setenv("DTRAIN_RUN_DIR", str(tmp_path / "run"))
    # The launch's own profile goes to the test's folder, not to the checkout's runs/.
    result = cli_in_process("launch", "--slots", "2", "--run-dir", str(tmp_path / "profile"),
                            str(tmp_path / "determined_mlp.py"), json.dumps(settings))
    assert result.code == 0, result.stderr
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["16", "24", "latest"]  # the 2 newest kept
    a, b = final_weights(det_runs(2)), final_weights(run)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert records(run) == records(det_runs(2))
    assert yaml.safe_load((run / "config.yaml").read_text())["entrypoint"] == "__main__:DetMLP"


FULL_EVAL = '''
import torch
from torch import nn

from determined_mlp import Counter, DetMLP
from dtrain.determined import pytorch


class FullEval(DetMLP):
    """Validates with evaluate_full_dataset on a model with BatchNorm (DDP buffers), and asks to stop early."""

    evaluate_batch = pytorch.PyTorchTrial.evaluate_batch  # the other way to validate, not both

    def __init__(self, context):
        self.context, self.hp, self.train_size = context, context.get_hparams(), 128
        self.model = context.wrap_model(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(),
                                                      nn.Linear(16, 1)))
        self.optimizer = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.05))
        self.scheduler = context.wrap_lr_scheduler(torch.optim.lr_scheduler.StepLR(self.optimizer, 1), "manual_step")
        self.counter = Counter(None, context.rank)

    def train_batch(self, batch, epoch_idx, batch_idx):
        if batch_idx == self.hp.get("stop_at_batch") and self.context.rank == 1:  # one rank asks
            self.context.set_stop_requested(True)
        return super().train_batch(batch, epoch_idx, batch_idx)

    def evaluate_full_dataset(self, data_loader):
        assert self.context.rank == 0, "evaluate_full_dataset runs on the chief only"
        records, squares = 0, 0.0
        for x, y in data_loader:
            records += len(x)
            squares += float(((self.model(x) - y) ** 2).sum())
        return {"mse": squares / records, "records": records}
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_evaluate_full_dataset_runs_on_the_chief_and_a_trial_can_stop_every_slot(tmp_path):
    cfg = det_config(tmp_path)
    (tmp_path / "full_eval.py").write_text(FULL_EVAL)
    cfg.write_text(cfg.read_text().replace("determined_mlp:DetMLP", "full_eval:FullEval"))
    train(cfg, tmp_path / "run", "--set", "resources.collective_timeout_seconds=10")
    validation = [r[2] for r in records(tmp_path / "run") if r[0] == "validation"]
    assert [v["records"] for v in validation] == [61, 61, 61]  # every record, on one slot, handed to all
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1)).eval()
    model.load_state_dict(final_weights(tmp_path / "run"))
    x, y = synthetic(61, seed=2).tensors
    with torch.no_grad():
        assert abs(validation[-1]["mse"] - nn.functional.mse_loss(model(x), y).item()) < 1e-5

    train(cfg, tmp_path / "stopped", "--set", "hyperparameters.stop_at_batch=9")
    stopped = json.loads((tmp_path / "stopped" / "logs" / "stopped.json").read_text())["batch"]
    assert 10 <= stopped < 24  # every slot stopped after the same batch, with a checkpoint there
    assert (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip() == str(stopped)


# The same experiment as CONFIG, as a Determined user wrote it: lengths in records, the launch layer's
# entrypoint, cluster settings dtrain ignores (named in one warning line), Determined's seed key.
DETERMINED_YAML = """\
name: det
description: the trial above, as Determined ran it
labels: [tests]
workspace: Research
project: dtrain
data:
  train_size: 128
hyperparameters:
  global_batch_size: 16
  hidden: {type: const, val: 16}
  lr: 0.05
  out: OUT
records_per_epoch: 128
searcher:
  name: single
  metric: mse
  smaller_is_better: true
  max_length:
    records: 384
min_validation_period:
  records: 128
min_checkpoint_period:
  batches: 8
scheduling_unit: 8
resources:
  slots_per_trial: 2
  resource_pool: cpu-pool
environment:
  image: determinedai/pytorch-ngc:0.35.0
bind_mounts:
  - host_path: /data
    container_path: /data
checkpoint_storage:
  type: s3
  bucket: checkpoints
  save_trial_latest: 2
reproducibility:
  experiment_seed: 3
entrypoint: python3 -m determined.launch.torch_distributed --trial determined_mlp:DetMLP
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_determined_experiment_yaml_runs_unchanged_and_trains_as_dtrains_own(det_runs, tmp_path, caplog):
    shutil.copy(TRIALS / "determined_mlp.py", tmp_path / "determined_mlp.py")
    cfg = tmp_path / "const.yaml"
    cfg.write_text(DETERMINED_YAML.replace("OUT", str(tmp_path)))
    result = cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "run"), "--quiet",
                            "--set", "profiling.enabled=false")
    assert result.code == 0, result.stderr
    ignored = [r.getMessage() for r in caplog.records if "Determined settings without effect" in r.getMessage()]
    assert len(ignored) == 1 and "environment" in ignored[0] and "bind_mounts" in ignored[0], caplog.text
    a, b = final_weights(det_runs(2)), final_weights(tmp_path / "run")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert records(tmp_path / "run") == records(det_runs(2))
