import logging

import pytest
from helpers import tiny_config, write

from dtrain.config.schema import apply_override, load_config
from dtrain.engine.data import per_slot_batch_size
from dtrain.errors import ConfigError, DataError


def test_valid_config_and_defaults(tmp_path):
    cfg = load_config(tiny_config(tmp_path))
    assert cfg.global_batch_size == 16
    assert cfg.resources.slots_per_trial == 2
    assert cfg.optimizations.average_training_metrics is True
    assert cfg.optimizations.tensor_fusion_threshold == 64.0
    assert cfg.code_dir == str(tmp_path.resolve())


def test_a_relative_code_dir_is_relative_to_the_config_file_not_to_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "exp").mkdir()
    monkeypatch.chdir(tmp_path / "exp")
    cfg = load_config(tiny_config(tmp_path, code_dir="../code"))
    assert cfg.code_dir == str(tmp_path.resolve() / "../code")
    assert load_config(tiny_config(tmp_path, code_dir="/abs/code")).code_dir == "/abs/code"


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("resourcs", {}, "unknown key 'resourcs'; did you mean 'resources'?"),
    ("resources.slots_per_trail", 2,
     "unknown key 'resources.slots_per_trail'; did you mean 'resources.slots_per_trial'?"),
    ("optimizations.agregation_frequency", 2, "did you mean 'optimizations.aggregation_frequency'?"),
])
def test_unknown_keys_suggest(tmp_path, key, value, expected):
    with pytest.raises(ConfigError) as info:
        load_config(tiny_config(tmp_path, **{key: value}))
    assert expected in str(info.value)


def test_wrong_type_names_path_value_and_expectation(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tiny_config(tmp_path, **{"resources.slots_per_trial": "two"}))
    msg = str(info.value)
    assert "resources.slots_per_trial" in msg and "'two'" in msg and "valid integer" in msg


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("max_length", {"batches": 1, "epochs": 1}, "exactly one of 'batches' or 'epochs'"),
    ("hyperparameters.global_batch_size", 0, "global_batch_size must be an integer >= 1"),
    ("entrypoint", "no_colon", "module:TrialClass"),
    ("backend", "mpi", "'auto', 'gloo' or 'nccl'"),
    ("optimizations.gradient_compression", "zip", "'none', 'fp16', 'bf16' or 'powersgd'"),
    ("optimizations.auto_tune_candidates_mb", [], "auto_tune_candidates_mb must be a non-empty list"),
    ("profiling.sample_every", 0, "profiling.sample_every: got 0 (int); expected a value greater than or equal to 1"),
])
def test_invalid_values(tmp_path, key, value, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(tiny_config(tmp_path, **{key: value}))
    assert fragment in str(info.value)


def test_average_training_metrics_is_supported(tmp_path):
    cfg = load_config(tiny_config(tmp_path, **{"optimizations.average_training_metrics": False}))
    assert cfg.optimizations.average_training_metrics is False


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = write(tmp_path / "bad.yaml", "entrypoint: a:B\nhyperparameters: [1,\n")
    with pytest.raises(ConfigError, match="malformed YAML at line"):
        load_config(bad)
    scalar = write(tmp_path / "scalar.yaml", "42\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(scalar)


def test_overrides_are_typed_and_nested(tmp_path):
    cfg = load_config(tiny_config(tmp_path), ["resources.slots_per_trial=1", "hyperparameters.lr=0.5",
                                               "max_length={epochs: 2}"])
    assert cfg.resources.slots_per_trial == 1
    assert cfg.hyperparameters["lr"] == 0.5
    assert cfg.max_length.epochs == 2 and cfg.max_length.batches is None


@pytest.mark.parametrize("item", ["novalue", "=3", "a..b=1"])
def test_malformed_override(item):
    with pytest.raises(ConfigError, match="--set expects KEY=VALUE"):
        apply_override({}, item)


def test_batch_split(caplog):
    assert per_slot_batch_size(64, 2) == 32
    with caplog.at_level(logging.WARNING):
        assert per_slot_batch_size(65, 2) == 32
    assert "effective global batch is 64" in caplog.text
    with pytest.raises(DataError, match="smaller than slots_per_trial 4"):
        per_slot_batch_size(3, 4)


def test_runs_read_for_their_samples_per_second_skip_the_probes_unless_the_config_names_them(tmp_path):
    from dtrain.config.model import samples_only_sets

    plain = tmp_path / "plain.yaml"
    write(plain, "name: x\nentrypoint: a:B\nhyperparameters: {global_batch_size: 4}\nmax_length: {batches: 2}\n")
    assert samples_only_sets(load_config(plain)) == ["profiling.probes=false"]
    assert samples_only_sets(load_config(plain, ["profiling.probes=true"])) == []  # the command named them
    assert samples_only_sets(load_config(tiny_config(tmp_path, **{"profiling.probes": True}))) == []
