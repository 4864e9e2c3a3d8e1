"""Determined experiment YAMLs, read as they are (dtrain.config.determined): the fixture tests/config/determined_yaml/
const.yaml loads with one warning line naming what it ignores and resolves to the right dtrain config; each
mapping, each refusal and the did-you-mean, in-process."""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ROOT, copy_trial, tiny_config

from dtrain import cli
from dtrain.config import safeyaml
from dtrain.config.determined import IGNORED, MAPPED, translate
from dtrain.config.schema import config_from_dict, load_config
from dtrain.errors import ConfigError

FIXTURES = Path(__file__).parent / "determined_yaml"
IGNORED_LINE = (
    "Determined settings without effect in dtrain, ignored: description, labels, workspace, project, "
    "records_per_epoch, environment, bind_mounts, checkpoint_policy, perform_initial_validation, "
    "resources.{resource_pool,priority,shm_size}, optimizations.tensor_fusion_cycle_time, "
    "profiling.{begin_on_batch,end_after_batch}, checkpoint_storage.{type,bucket,access_key,secret_key,"
    "save_experiment_best,save_trial_best} (docs/from-determined-config.md says why for each)")


def _fixture(tmp_path: Path, name: str = "const.yaml") -> Path:
    """The fixture beside a model_def.py whose MNistTrial is tests/trials/tiny.py's trial."""
    shutil.copy(FIXTURES / name, tmp_path / name)
    copy_trial(tmp_path)
    (tmp_path / "model_def.py").write_text("from tiny import TinyTrial as MNistTrial  # noqa: F401\n")
    return tmp_path / name


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_const_yaml_loads_with_one_warning_line_and_resolves(tmp_path, caplog):
    path = _fixture(tmp_path)
    with caplog.at_level(logging.WARNING):
        cfg = load_config(path)
    assert _warnings(caplog) == [f"{path}: {IGNORED_LINE}"]
    assert cfg.entrypoint == "model_def:MNistTrial"
    assert cfg.max_length.batches == 937  # 60,000 records // 64, as Determined's trainer rounds
    assert cfg.min_validation_period.batches == 100 and cfg.min_checkpoint_period.batches == 300  # 6,400 // 64
    assert cfg.resources.slots_per_trial == 2 and cfg.max_restarts == 3 and cfg.scheduling_unit == 50
    assert cfg.seed == 42  # reproducibility.experiment_seed
    assert cfg.hyperparameters["n_classes"] == 10 and cfg.hyperparameters["learning_rate"] == 1.0  # const: its value
    assert cfg.searcher.name == "single" and cfg.searcher.metric == "validation_loss"
    assert cfg.searcher.max_length.batches == 937
    assert cfg.data == {"url": "https://example.org/datasets/pytorch_mnist.tar.gz",
                        "secrets": {"token": "not-a-real-token"}}
    assert cfg.optimizations.aggregation_frequency == 2 and cfg.optimizations.gradient_compression == "none"
    assert cfg.precision == "32-true" and cfg.profiling.enabled is True
    assert cfg.checkpoint_storage.path == "checkpoints" and cfg.checkpoint_storage.save_trial_latest == 1
    dumped = safeyaml.dump(cfg.model_dump(mode="json"))
    assert "example-secret" not in dumped and "AKIAEXAMPLE" not in dumped  # storage credentials are dropped


def test_the_resolved_config_reads_back_unchanged_and_silent(tmp_path, caplog):
    cfg = load_config(_fixture(tmp_path))
    dumped = cfg.model_dump(mode="json")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = config_from_dict(safeyaml.load_text(safeyaml.dump(dumped), "config.yaml"))
    assert again.model_dump(mode="json") == dumped and not _warnings(caplog)
    assert translate(dumped, "x").raw == dumped and translate(dumped, "x").ignored == []


def test_dtrain_check_accepts_it_with_the_one_warning(tmp_path):
    path = _fixture(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["check", str(path), "--slots", "1", "--set", "max_length={batches: 8}"])
    assert code == 0, err.getvalue()
    warnings = [ln for ln in out.getvalue().splitlines() if ln.startswith("# warning: ")]
    assert [w for w in warnings if "Determined" in w] == [f"# warning: {path}: {IGNORED_LINE}"]
    resolved = safeyaml.load_text(out.getvalue(), "out")
    assert resolved["max_length"]["batches"] == 8 and resolved["resources"]["slots_per_trial"] == 1
    assert "environment" not in resolved and resolved["data"]["url"].endswith("pytorch_mnist.tar.gz")


# ------------------------------------------------------------------------------------------- lengths


@pytest.mark.parametrize(("records", "gbs", "batches"), [
    (60_000, 64, 937), (10, 3, 3), (64, 64, 1), (63, 64, 1), (1, 64, 1), (10**9, 1, 10**9)])
def test_records_become_batches_as_determined_rounds(tmp_path, records, gbs, batches):
    """max(records // global_batch_size, 1): the partial batch is dropped; less than one batch trains one."""
    cfg = load_config(tiny_config(tmp_path, max_length={"records": records},
                                  **{"hyperparameters.global_batch_size": gbs, "resources.slots_per_trial": 1}))
    assert cfg.max_length.batches == batches and cfg.max_length.epochs is None


@pytest.mark.parametrize("zero", [{"batches": 0}, {"records": 0}, {"epochs": 0}])
def test_a_period_of_zero_means_never(tmp_path, zero):
    cfg = load_config(tiny_config(tmp_path, min_validation_period=zero, min_checkpoint_period=zero))
    assert cfg.min_validation_period is None and cfg.min_checkpoint_period is None


def test_the_searchers_length_serves_when_max_length_is_absent(tmp_path):
    searcher = {"name": "single", "metric": "mse", "max_length": {"records": 160}}
    path = tiny_config(tmp_path, searcher=searcher)
    raw = yaml.safe_load(path.read_text())
    del raw["max_length"]
    path.write_text(yaml.safe_dump(raw))
    assert load_config(path).max_length.batches == 10  # 160 records // 16
    assert load_config(tiny_config(tmp_path, searcher=searcher)).max_length.batches == 24  # its own wins


@pytest.mark.parametrize(("time_metric", "max_time", "expected"), [
    ("batches", 937, {"batches": 937}), ("epochs", 3, {"epochs": 3})])
def test_time_metric_and_max_time_are_the_length(tmp_path, time_metric, max_time, expected):
    """Determined 0.38 wrote the searcher's length as a progress metric and its final value."""
    searcher = {"name": "single", "metric": "mse", "time_metric": time_metric, "max_time": max_time}
    cfg = load_config(tiny_config(tmp_path, searcher=searcher))
    assert cfg.searcher.max_length.model_dump(exclude_none=True) == expected


# ------------------------------------------------------------------------------------------ mappings


@pytest.mark.parametrize(("overrides", "check"), [
    ({"entrypoint": "python3 -m determined.launch.torch_distributed --trial tiny:TinyTrial"},
     lambda c: c.entrypoint == "tiny:TinyTrial"),
    ({"entrypoint": ["python3", "-m", "determined.launch.horovod", "--trial=tiny:TinyTrial"]},
     lambda c: c.entrypoint == "tiny:TinyTrial"),
    ({"optimizations": {"gradient_compression": True}}, lambda c: c.optimizations.gradient_compression == "fp16"),
    ({"optimizations": {"mixed_precision": "O1"}}, lambda c: c.precision == "16-mixed"),
    ({"resources": {"slots_per_trial": 0}, "backend": None},
     lambda c: c.resources.slots_per_trial == 1 and c.backend == "gloo"),
    ({"checkpoint_storage": {"type": "shared_fs", "host_path": "/mnt/ckpt", "save_trial_latest": 0}},
     lambda c: c.checkpoint_storage.path == "checkpoints" and c.checkpoint_storage.save_trial_latest == 1),
    ({"reproducibility": {"experiment_seed": 7}, "seed": None}, lambda c: c.seed == 7),
    ({"searcher": {"name": "async_halving", "metric": "mse", "num_rungs": 3, "max_trials": 9, "stop_once": True}},
     lambda c: (c.searcher.name, c.searcher.mode, c.searcher.max_rungs) == ("adaptive_asha", "aggressive", 3)),
    ({"searcher": {"name": "adaptive_asha", "metric": "mse", "max_trials": 8, "divisor": 3.0,
                   "source_trial_id": None, "bracket_rungs": []}}, lambda c: c.searcher.divisor == 3),
    ({"hyperparameters.opt": {"kind": "sgd", "lr": {"type": "const", "val": 0.1}}},
     lambda c: c.hyperparameters["opt"] == {"kind": "sgd", "lr": 0.1}),
])
def test_mappings(tmp_path, overrides: dict[str, Any], check):
    overrides = dict(overrides)
    drop = [k for k, v in overrides.items() if v is None]
    path = tiny_config(tmp_path, **{k: v for k, v in overrides.items() if v is not None})
    raw = yaml.safe_load(path.read_text())
    for key in drop:
        del raw[key]
    path.write_text(yaml.safe_dump(raw))
    assert check(load_config(path))


# ----------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("overrides", "fragment"), [
    ({"entrypoint": "python3 train.py --epochs 1"}, "runs a script (Determined's Core API), not a Trial class"),
    ({"entrypoint": "python3 -m determined.launch.deepspeed --trial m:T"}, "a DeepSpeedTrial"),
    ({"searcher": {"name": "single", "metric": "mse", "source_checkpoint_uuid": "3f1c"}},
     "searcher.source_checkpoint_uuid: dtrain cannot start trials from a checkpoint"),
    ({"searcher": {"name": "pbt", "metric": "mse"}}, "searcher.name: 'pbt' (population-based training) is not in"),
    ({"searcher": {"name": "single", "metric": "mse", "max_length": 50}}, "searcher.max_length: got 50 with no unit"),
    ({"searcher": {"name": "adaptive_asha", "metric": "mse", "max_trials": 4, "divisor": 2.5}},
     "searcher.divisor: got 2.5"),
    ({"searcher": {"name": "single", "metric": "mse", "time_metric": "steps", "max_time": 5}},
     "searcher.time_metric: got 'steps'"),
    ({"searcher": {"name": "single", "metric": "mse", "time_metric": "batches", "max_time": 5,
                   "max_length": {"batches": 6}}}, "disagree; keep one of the two"),
    ({"optimizations": {"mixed_precision": "O2"}}, "but not O2/O3"),
    ({"optimizations": {"mixed_precision": "O1"}, "precision": "bf16-mixed"}, "keep one of the two"),
    ({"checkpoint_storage": {"type": "nfs"}}, "checkpoint_storage.type: got 'nfs'"),
    ({"reproducibility": {"experiment_seed": 1}}, "reproducibility.experiment_seed 1 and seed 3 disagree"),
    ({"reproducibility": {"experiment_seed": "1"}}, "reproducibility.experiment_seed: got '1' (str)"),
    ({"max_length": {"records": 0}}, "max_length.records: got 0"),
    ({"max_length": {"records": 160, "batches": 2}}, "give exactly one of 'batches', 'records' or 'epochs'"),
    ({"max_length": {"records": 160}, "hyperparameters.global_batch_size": {"type": "int", "minval": 8,
                                                                           "maxval": 16}},
     "max_length: {records: 160} is converted with global_batch_size"),
    ({"resources": {"slots_per_trial": 0}, "backend": "nccl"}, "asks for a trial without GPUs but backend is nccl"),
    ({"data": {"rate": float("inf")}}, "data.rate is inf; use a finite number"),
])
def test_what_dtrain_cannot_honour_is_refused_in_one_line(tmp_path, overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(tiny_config(tmp_path, **overrides))
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"enviroment": {"image": "x"}}, "unknown key 'enviroment'; did you mean 'environment'?"),
    ({"resources.resource_pol": "gpu"},
     "unknown key 'resources.resource_pol'; did you mean 'resources.resource_pool'?"),
    ({"checkpoint_storage": {"type": "s3", "buckett": "b"}}, "did you mean 'checkpoint_storage.bucket'?"),
    ({"searcher": {"name": "single", "metric": "mse", "time_metrc": "batches"}},
     "did you mean 'searcher.time_metric'?"),
    ({"resourcs": {}}, "unknown key 'resourcs'; did you mean 'resources'?"),
    ({"min_checkpoint_policy": "best"}, "unknown key 'min_checkpoint_policy'"),
    ({"environment.image": "x", "bogus": 1}, "unknown key 'bogus'"),
])
def test_unknown_keys_stay_errors_with_a_did_you_mean(tmp_path, overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(tiny_config(tmp_path, **overrides))
    assert expected in str(info.value)


def test_set_over_a_determined_file_warns_once_and_checks_the_files_values(tmp_path, caplog):
    path = _fixture(tmp_path)
    with caplog.at_level(logging.WARNING):
        cfg = load_config(path, ["max_length={batches: 10}", "resources.slots_per_trial=1"])
    assert cfg.max_length.batches == 10 and cfg.resources.slots_per_trial == 1 and len(_warnings(caplog)) == 1
    text = path.read_text().replace("  slots_per_trial: 2", '  slots_per_trial: "2"')
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"resources\.slots_per_trial: got '2'.*the command line's"):
        load_config(path, ["resources.slots_per_trial=1"])


def test_the_doc_table_names_every_key_dtrain_ignores_or_maps():
    doc = (ROOT / "docs" / "from-determined-config.md").read_text()
    missing = [k for k in (*IGNORED, *MAPPED) if f"`{k}`" not in doc]
    assert not missing, missing
