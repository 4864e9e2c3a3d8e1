"""dtrain search on Determined experiment YAMLs: the plan of tests/config/determined_yaml/adaptive.yaml (brackets,
rungs, lengths, the one warning line), ASHA's brackets as Determined's master forms them, and the bracket
pruner keeping each bracket's selection to its own trials. In-process; one real search is marked slow."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import optuna
import pytest
import yaml
from helpers import TRIALS, cli_in_process, tiny_config

from dtrain.config import rungs as asha
from dtrain.config.schema import Length, SearcherConfig, load_config
from dtrain.errors import ConfigError
from dtrain.profiling.record import load_profile
from dtrain.search.space import load_plan

FIXTURES = Path(__file__).parents[1] / "config" / "determined_yaml"


def test_the_adaptive_yaml_plans_determineds_brackets(tmp_path):
    shutil.copy(FIXTURES / "adaptive.yaml", tmp_path / "adaptive.yaml")
    plan = load_plan(tmp_path / "adaptive.yaml")
    # max_length 4 epochs, divisor 4: log4(4) + 1 = 2 rungs; mode standard: brackets of 2 and 1 rungs,
    # 16 trials shared by budget (weights 4/2 and 1/1): 10 + 5, the remainder to the first.
    assert plan.unit == "epochs" and plan.lengths == (1, 4) and plan.max_trials == 16
    assert plan.brackets.lengths == ((1, 4), (4,)) and plan.brackets.trials == (11, 5)
    assert [plan.brackets.of(n) for n in range(16)] == [0, 1] * 5 + [0] * 6
    assert plan.rungs_text() == "1, 4 (11 trials) | 4 (5 trials)"
    assert plan.warnings == (f"{tmp_path / 'adaptive.yaml'}: Determined settings without effect in dtrain, ignored: "
                             "description, records_per_epoch, environment, bind_mounts, resources.resource_pool, "
                             "checkpoint_storage.{type,bucket} (docs/from-determined-config.md says why for each)",)
    assert "using 2 rung(s)" in plan.notes[0] and plan.searcher.max_concurrent_trials == 4
    assert set(plan.space.searched) == {"learning_rate", "n_filters1", "n_filters2", "dropout1", "dropout2",
                                        "optimizer"}
    trial = plan.trial_config({"learning_rate": 0.1, "n_filters1": 8, "n_filters2": 9, "dropout1": 0.3,
                               "dropout2": 0.4, "optimizer": "sgd"})
    assert trial["hyperparameters"]["n_classes"] == 10  # the const range, a plain value
    assert trial["max_length"] == {"epochs": 4} and trial["min_validation_period"] == {"batches": 200}
    assert not {"environment", "bind_mounts", "records_per_epoch", "description", "searcher"} & set(trial)
    assert trial["resources"] == {"slots_per_trial": 2} and trial["checkpoint_storage"] == {}
    assert plan.next_length(None, 1) == 4 and plan.next_length(1, 0) == 4 and plan.next_length(None, 0) == 1


def test_determined_038_time_metric_and_async_halving(tmp_path):
    searcher = {"name": "adaptive_asha", "metric": "mse", "time_metric": "batches", "max_time": 937,
                "max_trials": 16}
    plan = load_plan(tiny_config(tmp_path, searcher=searcher, **{"resources.slots_per_trial": 1}))
    # 16 trials select at 3 rungs of divisor 4 (5 asked): 937 // 16, 937 // 4, 937.
    assert plan.lengths == (58, 234, 937) and plan.unit == "batches"
    assert "using 3 rung(s), as Determined does" in plan.warnings[0]
    assert "searcher.mode not given" in plan.notes[-1]
    halving = {"name": "async_halving", "metric": "mse", "num_rungs": 2, "max_trials": 4, "divisor": 2,
               "max_length": {"records": 256}}
    plan = load_plan(tiny_config(tmp_path, searcher=halving, **{"resources.slots_per_trial": 1}))
    assert plan.lengths == (8, 16) and plan.brackets.trials == (4,)  # 256 records // 16 = 16 batches


@pytest.mark.parametrize(("mode", "counts"), [("aggressive", (5,)), ("standard", (5, 4, 3)),
                                              ("conservative", (5, 4, 3, 2, 1)), (None, (5,))])
def test_modes_form_determineds_brackets(mode, counts):
    searcher = SearcherConfig(name="adaptive_asha", metric="m", max_trials=1000, mode=mode)
    b = asha.brackets(searcher, Length(batches=1024))
    assert tuple(len(ls) for ls in b.lengths) == counts and all(ls[-1] == 1024 for ls in b.lengths)
    assert b.lengths[0] == (4, 16, 64, 256, 1024) and sum(b.trials) == 1000
    if mode == "standard":  # weights 4^4/5, 4^3/4, 4^2/3 of 1000, rounded down, the rest to the first
        assert b.trials == (707, 220, 73) and b.lengths[2] == (64, 256, 1024)
    numbers = [b.of(n) for n in range(1000)]
    assert tuple(numbers.count(i) for i in range(len(counts))) == b.trials


def test_explicit_bracket_rungs_and_merged_rung_ends():
    searcher = SearcherConfig(name="adaptive_asha", metric="m", max_trials=8, divisor=4, bracket_rungs=[1, 3])
    b = asha.brackets(searcher, Length(batches=10))
    assert b.lengths == ((1, 2, 10), (10,))  # 10 // 16 = 0 -> 1, 10 // 4 = 2, 10


def test_each_bracket_selects_among_its_own_trials(tmp_path):
    """Brackets (2, 4, 8) and (4, 8) batches: trial 3, in the second bracket, finishes its first rung (4 batches)
    second-best of everything reported at rung 0 but best of its own bracket, and goes on."""
    searcher = {"name": "adaptive_asha", "metric": "mse", "max_trials": 8, "divisor": 2, "max_rungs": 3,
                "mode": "standard"}
    plan = load_plan(tiny_config(tmp_path, searcher=searcher, max_length={"batches": 8},
                                 **{"resources.slots_per_trial": 1}))
    assert plan.brackets.lengths == ((2, 4, 8), (4, 8)) and plan.brackets.trials == (5, 3)
    assert [plan.brackets.of(n) for n in range(4)] == [0, 1, 0, 1]
    study = optuna.create_study(direction=plan.direction, pruner=plan.pruner())

    def report(value: float, length: int) -> bool:
        trial = study.ask()
        trial.report(value, length)
        return trial.should_prune()

    assert report(0.1, 2) is False  # trial 0, bracket 0: alone at its first rung
    assert report(9.0, 4) is False  # trial 1, bracket 1: alone at its first rung
    assert report(5.0, 2) is True  # trial 2, bracket 0: 2 results, only the best goes on
    assert report(1.0, 4) is False  # trial 3, bracket 1: best of (9.0, 1.0); 0.1 is another bracket's


def test_records_with_a_searched_batch_size_are_refused(tmp_path):
    cfg = tiny_config(tmp_path, searcher={"name": "random", "metric": "mse", "max_trials": 2},
                      max_length={"records": 256},
                      **{"hyperparameters.global_batch_size": {"type": "categorical", "vals": [8, 16]}})
    with pytest.raises(ConfigError, match=r"max_length: \{records: 256\} is converted with global_batch_size"):
        load_plan(cfg)


@pytest.mark.slow
def test_a_determined_search_runs_its_brackets(tmp_path):
    """A Determined 0.38-style adaptive search (launch-module entrypoint, time_metric/max_time, mode standard,
    cluster keys) runs as it is: every trial finishes its bracket's rungs, two at a time on 2 slots, each an
    ordinary run directory. (Trials stopped at a rung: test_search.py's ASHA search.)"""
    # A trial written against Determined's API (two import lines changed), as its users bring it.
    shutil.copy(TRIALS / "determined_mlp.py", tmp_path / "determined_mlp.py")
    config = {
        "name": "tiny_adaptive", "description": "as Determined 0.38 wrote it", "data": {"train_size": 64},
        "hyperparameters": {"global_batch_size": 16,
                            "lr": {"type": "categorical", "vals": [0.0, 0.01, 0.05, 0.1]}},
        "searcher": {"name": "adaptive_asha", "metric": "mse", "time_metric": "batches", "max_time": 8,
                     "max_trials": 2, "mode": "standard", "divisor": 2, "max_rungs": 3},
        "resources": {"slots_per_trial": 1, "resource_pool": "cpu"}, "backend": "gloo",
        "environment": {"image": "determinedai/pytorch-ngc:0.35.0"}, "seed": 3,
        "entrypoint": "python3 -m determined.launch.torch_distributed --trial determined_mlp:DetMLP"}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "search"
    result = cli_in_process("search", str(tmp_path / "s.yaml"), "--slots", "2", "--out", str(out))
    assert result.code == 0, result.stdout + result.stderr
    # 2 trials at divisor 2 select at 2 rungs (Determined's rule), one bracket each: trial 0, alone at its
    # first rung, is promoted, and its promotion resumes it from its checkpoint.
    assert "mse at 4, 8 (1 trial) | 8 (1 trial) batches" in result.stdout
    assert "2 at a time on 2 slot(s)" in result.stdout and "best trial" in result.stdout
    assert "trial 0 continues from its checkpoint to 8 batches" in result.stdout
    assert result.stderr.count("Determined settings without effect in dtrain, ignored: description, environment, "
                               "resources.resource_pool") == 1
    trials = {t["trial"]: t for t in json.loads((out / "trials.json").read_text())["trials"]}
    assert all(t["state"] == "completed" and t["batches"] == 8 for t in trials.values()), trials
    for n in trials:  # each trial an ordinary run directory
        assert (out / "trials" / str(n) / "checkpoints" / "latest").is_file()
        assert (out / "trials" / str(n) / "summary.json").is_file()
    assert "environment" not in (out / "trials" / "0" / "trial.yaml").read_text()
    best = load_config(out / "best.yaml")  # runnable with dtrain run: single values, no searcher
    assert best.searcher is None and best.max_length.batches == 8
    assert best.hyperparameters["lr"] == min(trials.values(), key=lambda t: t["value"])["hyperparameters"]["lr"]
    assert (out / "search.png").stat().st_size > 1000
    assert "<img src=\"data:image/png;base64," in (out / "search.html").read_text()
    # The trials skipped the end-of-run probes (the config does not name them); best.yaml keeps the default.
    assert not load_profile(out / "trials" / "0" / "profile.json").probes
    assert "probes" not in (out / "best.yaml").read_text()
