"""A value of the file that an override replaces is still checked (dtrain.config.filevalues), in-process.

The issue's case: ``resources.slots_per_trial: "2"`` with ``--slots 1`` was accepted, and the same file without
``--slots`` is refused. What the file leaves out (keys the command line supplies) stays allowed.
"""

import random

import pytest
import yaml
from helpers import tiny_config
from pydantic import ValidationError

from dtrain.cli import main
from dtrain.config.bounds import MAX_GLOBAL_BATCH
from dtrain.config.schema import HPARAM_TYPES, ExperimentConfig, load_config
from dtrain.errors import ConfigError
from dtrain.search.space import load_plan

FIX = "but the file's own values must be valid too"


def _refused(path, overrides):
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_issues_case_names_the_files_key_value_and_fix(tmp_path, capsys):
    cfg = tiny_config(tmp_path, **{"resources.slots_per_trial": "2"})
    message = _refused(cfg, ["resources.slots_per_trial=1"])
    assert message == (f"{cfg}: resources.slots_per_trial: got '2' (str); expected a valid integer; the command "
                       f"line's resources.slots_per_trial=1 replaces it, {FIX}: write 2 without quotes in {cfg}")
    assert main(["check", str(cfg), "--slots", "1"]) == 2  # --slots is that override
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "resources.slots_per_trial: got '2' (str)" in err


@pytest.mark.parametrize(("key", "written", "override", "fragment"), [
    ("seed", "3", "seed=4", "seed: got '3' (str); expected a valid integer"),
    ("resources.collective_timeout_seconds", "60", "resources.collective_timeout_seconds=30",
     "got '60' (str); expected a valid number; the command line's resources.collective_timeout_seconds=30 replaces "
     f"it, {FIX}: write 60 without quotes in "),
    ("name", "../x", "name=ok", "name: must be 1 to 100 letters"),
    ("backend", "mpi", "backend=gloo", "backend: got 'mpi' (str); expected 'auto', 'gloo' or 'nccl'"),
    ("max_length.batches", 0, "max_length.batches=4", "max_length.batches: got 0 (int); expected a value greater"),
    ("checkpoint_storage.path", "../out", "checkpoint_storage.path=ck", "leaves the run directory"),
    ("hyperparameters.global_batch_size", "16", "hyperparameters.global_batch_size=8",
     "hyperparameters.global_batch_size: got '16' (str); expected an integer from 1 to 16,777,216"),
    ("hyperparameters.lr", float("nan"), "hyperparameters.lr=0.1", "hyperparameters.lr is nan; use a finite number"),
    # A whole section replaced: its values are the file's too.
    ("resources.slots_per_trial", "2", "resources={slots_per_trial: 1}", "resources.slots_per_trial: got '2'"),
    ("resources.slots_pre_trial", 2, "resources={slots_per_trial: 1}",
     "unknown key 'resources.slots_pre_trial'; did you mean 'resources.slots_per_trial'?"),
])
def test_a_replaced_value_is_checked_as_the_schema_checks_it(tmp_path, key, written, override, fragment):
    cfg = tiny_config(tmp_path, **{key: written})
    message = _refused(cfg, [override])
    assert fragment in message and (FIX in message or "unknown key" in message), message
    with pytest.raises(ConfigError):  # the file alone is refused too: nothing new is refused
        load_config(cfg)


def test_valid_files_with_overrides_still_load(tmp_path):
    cfg = tiny_config(tmp_path)
    config = load_config(cfg, ["resources.slots_per_trial=1", "seed=4", "hyperparameters.lr=0.1",
                               "resources={slots_per_trial: 3}"])
    assert config.resources.slots_per_trial == 3 and config.seed == 4 and config.hyperparameters["lr"] == 0.1


def test_what_the_file_leaves_out_may_come_from_the_command_line(tmp_path):
    path = tmp_path / "partial.yaml"
    path.write_text(yaml.safe_dump({"hyperparameters": {"lr": 0.1}, "max_length": {}}))
    config = load_config(path, ["entrypoint=tiny:TinyTrial", "hyperparameters.global_batch_size=8",
                                "max_length.batches=4"])
    assert config.global_batch_size == 8 and config.max_length.batches == 4
    # A search range replaced by a single value (dtrain run of a search config) is not a wrong value either.
    cfg = tiny_config(tmp_path, **{"hyperparameters.lr": {"type": "double", "minval": 0, "maxval": 1}})
    assert load_config(cfg, ["hyperparameters.lr=0.5"]).hyperparameters["lr"] == 0.5


def test_search_overrides_check_the_file_too(tmp_path):
    cfg = tiny_config(tmp_path, **{"resources.slots_per_trial": 1, "hyperparameters.lr": {
        "type": "double", "minval": 0, "maxval": 1}, "searcher": {"name": "random", "metric": "mse",
                                                                   "max_trials": "8"}})
    with pytest.raises(ConfigError, match=r"searcher\.max_trials: got '8' \(str\).*write 8 without quotes"):
        load_plan(cfg, ["searcher.max_trials=4"])


# ------------------------------------------------------------------------------------------- fuzz

VALID = {"resources.slots_per_trial": [1, 3], "resources.collective_timeout_seconds": [30, 60.5], "seed": [0, 7],
         "scheduling_unit": [1, 8], "max_restarts": [0, 2], "name": ["ok", "a-b.c"], "max_length.batches": [4, 10],
         "hyperparameters.global_batch_size": [8, 32], "optimizations.tensor_fusion_threshold": [0, 25.0],
         "optimizations.aggregation_frequency": [1, 2], "data_loader.num_workers": [0, 1],
         "profiling.warmup_steps": [0, 3], "checkpoint_storage.path": ["ck", "a/b"], "backend": ["gloo", "auto"],
         "precision": ["32-true", "bf16-mixed"], "sync.strategy": ["ddp", "allreduce"]}
ANY = [True, "2", "abc", "", None, [], {}, [1, 2], 1.5, -1, 0, 2**64, float("nan"), float("inf"), "16-mixed", "x" * 200,
       "../x", "a\x00b", {"batches": 3}, {"type": "int", "minval": 1, "maxval": 4}]
SEED = 20240612


def _loads(path, overrides=()):
    try:
        load_config(path, list(overrides))
        return True
    except ConfigError as exc:
        assert "\n" not in str(exc), str(exc)
        return False


def _wrong_alone(key, value):
    """Whether the schema refuses ``value`` at ``key`` by the key's own rules (its type, bounds, validator),
    judged on the key's section given nothing else: what the file gives, not what it leaves out."""
    *sections, leaf = key.split(".")
    if sections == ["hyperparameters"]:  # global_batch_size, the one hyperparameter the schema types
        if isinstance(value, dict) and value.get("type") in HPARAM_TYPES:
            return False  # a search range: dtrain run of a search config with a single value given
        return isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_GLOBAL_BATCH
    model = ExperimentConfig
    for section in sections:
        model = model.model_fields[section].annotation
    try:
        model.model_validate({leaf: value})
    except ValidationError as exc:
        return any(e["loc"][:1] == (leaf,) for e in exc.errors() if e["type"] != "missing")
    return False


def test_file_and_override_fuzz_never_trace_back_and_judge_the_file(tmp_path):
    """Seeded: a TINY config whose KEY the file sets to one value and an override to another. Never anything
    but a one-line ConfigError; it loads exactly when the overridden config is valid and the file's value at
    KEY is one the key's own rules accept."""
    rng = random.Random(SEED)
    outcomes = {"loaded": 0, "refused": 0, "refused for the file": 0}
    (tmp_path / "base").mkdir()
    base = tiny_config(tmp_path / "base")
    for i in range(300):
        key = rng.choice(sorted(VALID))
        written, given = (rng.choice(VALID[key] if rng.random() < 0.5 else ANY) for _ in range(2))
        folder = tmp_path / str(i)
        folder.mkdir()
        cfg = tiny_config(folder, **{key: written})
        text = yaml.safe_dump(given, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
        override = f"{key}={text}"
        merged_ok = _loads(base, [override])  # the base file's own value at KEY is valid
        loaded = _loads(cfg, [override])
        outcomes["loaded" if loaded else "refused"] += 1
        label = f"{key}: file {written!r}, --set {override}"
        assert loaded == (merged_ok and not _wrong_alone(key, written)), label
        if merged_ok and not loaded:
            with pytest.raises(ConfigError) as info:
                load_config(cfg, [override])
            assert key in str(info.value) and FIX in str(info.value), f"{label}: {info.value}"
            outcomes["refused for the file"] += 1
    print(f"\nfile+override fuzz: {outcomes}")
    assert outcomes["loaded"] > 30 and outcomes["refused for the file"] > 30, outcomes
