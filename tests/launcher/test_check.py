"""``dtrain check`` refuses what ``dtrain run`` refuses before training, the trial's data included: the trial is
built in the checking process (a world of one) and its data judged for the config's real slot count. All
in-process: no worker starts, and nothing of the dry run outlives it.
"""

import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as tdist
from helpers import cli_in_process, tiny_config, write

from dtrain.launcher import dryrun, runs

SMALL_DATA = "the training data has 50 records, fewer than 64: one global batch needs 64; lower the batch size"


def _check(cfg, *args):
    result = cli_in_process("check", str(cfg), *args)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def _one_line_error(result, fragment):
    assert result.code == 2 and not result.stdout, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and fragment in result.stderr, result.stderr


def test_a_data_set_smaller_than_the_global_batch_is_refused_as_run_refuses_it(tmp_path):
    # The case: 50 records, global batch 64 (run: rc 2 with this line, from its workers).
    cfg = tiny_config(tmp_path, **{"hyperparameters.global_batch_size": 64, "hyperparameters.train_size": 50})
    _one_line_error(_check(cfg), f"dtrain: error: {SMALL_DATA}\n")
    _one_line_error(_check(cfg, "--slots", "1"), SMALL_DATA)


def test_the_data_is_judged_for_the_configs_slots_not_the_world_of_one(tmp_path):
    # 64 over 3 slots is 21 each, an effective global batch of 63: 63 records make one batch on 3 slots, none
    # on 1 (a check made for the world of one the dry run builds in would refuse both).
    cfg = tiny_config(tmp_path, **{"hyperparameters.global_batch_size": 64, "hyperparameters.train_size": 63,
                                   "max_length": {"epochs": 2}})
    ok = runs.check(cfg, ["resources.slots_per_trial=3"])
    assert ok.per_slot_batch == 21 and ok.training_slots == 3
    assert ok.trial_data == dryrun.DataFacts(training_records=63, validation_records=61, batches_per_epoch=1,
                                             total_batches=2)
    _one_line_error(_check(cfg, "--slots", "1"), "the training data has 63 records, fewer than 64")


def test_validation_data_needs_a_record_per_slot(tmp_path):
    cfg = tiny_config(tmp_path, **{"hyperparameters.val_size": 1})
    _one_line_error(_check(cfg), "the validation data has 1 records, fewer than 2: every one of the 2 slots needs "
                                 "at least one")
    assert _check(cfg, "--slots", "1").code == 0


def test_parameter_server_data_is_split_over_its_workers_only(tmp_path):
    # 3 slots, 1 server: 2 workers share each global batch of 16 (the server rank holds no data).
    cfg = tiny_config(tmp_path, **{"sync.strategy": "parameter_server", "resources.slots_per_trial": 3})
    result = runs.check(cfg, [])
    assert result.training_slots == 2 and result.per_slot_batch == 8
    assert result.trial_data.batches_per_epoch == 256 // 16


def test_check_prints_what_the_trial_gives(tmp_path):
    result = _check(tiny_config(tmp_path))
    assert result.code == 0, result.stderr
    assert ("# data: 256 training records, 16 global batch(es) of 16 per epoch (max_length: 24 batches); "
            "61 validation records\n") in result.stdout
    result = _check(tiny_config(tmp_path, **{"hyperparameters.val_size": 0}))
    assert "; no validation data\n" in result.stdout


def test_more_loader_processes_than_cores_get_no_torch_warning(tmp_path):
    """torch warns in many lines when a DataLoader is made with more processes than cores; the check makes the
    loaders without starting them, and the preflight says it in one line (a tuned.yaml with the doctor's
    loader advice is checked so)."""
    import warnings

    cfg = tiny_config(tmp_path, **{"data_loader.num_workers": 2 * (os.cpu_count() or 1)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        result = _check(cfg)
    assert result.code == 0, result.stderr


def test_a_trial_that_raises_while_built_is_one_line_naming_where(tmp_path):
    cfg = tiny_config(tmp_path, **{"hyperparameters.train_size": "many"})
    _one_line_error(_check(cfg), "entrypoint 'tiny:TinyTrial': building the trial as each worker of dtrain run "
                                 "would failed with TypeError: ")
    assert " at tiny.py:" in _check(cfg).stderr and "in synthetic; fix the trial" in _check(cfg).stderr


def test_callbacks_are_checked_as_the_trainer_checks_them(tmp_path):
    write(tmp_path / "cb.py", """
        from tiny import TinyTrial

        class ListCallbacks(TinyTrial):
            def build_callbacks(self):
                return []
        """)
    cfg = tiny_config(tmp_path, entrypoint="cb:ListCallbacks")
    _one_line_error(_check(cfg), "build_callbacks() returned a list; return a dict of name -> dtrain.LoopCallback")


def test_nothing_of_the_dry_run_is_left_in_the_process(tmp_path):
    """No process group, launcher variable, thread count or RNG state changed: check runs inside the CLI's
    process and inside other programs (the tests' own OMP_NUM_THREADS=1 would set one thread)."""
    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        environ = dict(os.environ)
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)
        states = random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state()
        result = runs.check(tiny_config(tmp_path), [])
        assert result.trial_data is not None and not tdist.is_initialized()
        assert dict(os.environ) == environ and torch.get_num_threads() == 2
        assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])
        assert torch.equal(torch.random.get_rng_state(), states[2])
        # The same dry run again, and a failing one: the group is made and gone each time.
        assert runs.check(tiny_config(tmp_path), []).trial_data == result.trial_data
        with pytest.raises(Exception, match="fewer than 16"):
            runs.check(tiny_config(tmp_path, **{"hyperparameters.train_size": 3}), [])
        assert not tdist.is_initialized() and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before_threads)


def test_a_context_that_fails_leaves_no_group_and_is_not_blamed_on_the_trial(tmp_path, monkeypatch):
    def failing_context(config):
        tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
        raise RuntimeError("Gloo: no usable network interface\nmore detail")

    from dtrain.engine.trial import PyTorchTrial

    monkeypatch.setattr(PyTorchTrial, "context_class", failing_context)  # the context the dry run builds
    _one_line_error(_check(tiny_config(tmp_path)), "making a one-process group to build the trial in (each worker "
                    "of dtrain run makes one too) failed with RuntimeError: Gloo: no usable network interface at ")
    assert not tdist.is_initialized()


def test_a_process_already_in_a_group_keeps_it_and_is_told_what_was_not_checked(tmp_path):
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        result = runs.check(tiny_config(tmp_path), [])
        assert tdist.is_initialized() and result.trial_data is None
        assert any(w.startswith("the trial's data was not checked (this process already belongs to a process "
                                "group)") for w in result.warnings)
    finally:
        tdist.destroy_process_group()


def test_launcher_ranks_are_not_built_in(monkeypatch):
    assert dryrun.obstacle() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert dryrun.obstacle() == "this process is rank 1 of 2 started by a launcher"


def test_check_warns_of_a_search_too_small_for_its_rungs(tmp_path):
    searcher = {"name": "adaptive_asha", "metric": "mse", "max_trials": 4, "max_rungs": 5, "divisor": 4}
    result = _check(tiny_config(tmp_path, searcher=searcher, max_length={"batches": 1024}))
    assert result.code == 0, result.stderr
    assert "# warning: searcher: max_trials 4 is too few for adaptive_asha's 5 rungs with divisor 4" in result.stdout
