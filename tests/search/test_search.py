"""dtrain search: the searcher schema (in-process), a grid search, an ASHA search that stops trials early,
and a search interrupted with Ctrl-C then resumed. Trials are tests/trials/tiny.py on 1 slot, a few batches.

tiny.py's validation set follows another function than its training set, so validation mse only grows with
training: lr 0 is the best trial, which makes the searches' outcomes deterministic.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from helpers import ROOT, cli_in_process, tiny_config

from dtrain.cli import main
from dtrain.config import rungs as asha
from dtrain.config.schema import Length, SearcherConfig, load_config
from dtrain.errors import ConfigError
from dtrain.search import runner
from dtrain.search.space import load_plan

ASHA = {"name": "adaptive_asha", "metric": "mse", "max_trials": 3, "divisor": 2, "max_rungs": 2}


def search_config(tmp_path: Path, searcher: dict, **overrides) -> Path:
    return tiny_config(tmp_path, **{"resources.slots_per_trial": 1, "searcher": searcher, **overrides})


# ------------------------------------------------------------------------------------------- schema


def test_plan_from_ranges(tmp_path):
    cfg = search_config(tmp_path, ASHA, **{
        "hyperparameters.lr": {"type": "log", "minval": -3, "maxval": -1, "count": 3},
        "hyperparameters.opt": {"kind": "sgd",
                                "momentum": {"type": "double", "minval": 0.0, "maxval": 0.9, "count": 2}},
        "hyperparameters.width": {"type": "int", "minval": 4, "maxval": 6, "count": 5},
        "hyperparameters.act": {"type": "categorical", "vals": ["relu", "tanh"]},
        "hyperparameters.fixed": {"type": "const", "val": 7},
        "max_length": {"batches": 10}})
    plan = load_plan(cfg)
    assert plan.lengths == (5, 10) and plan.unit == "batches" and plan.max_trials == 3
    assert set(plan.space.searched) == {"lr", "opt.momentum", "width", "act"}
    grid = plan.space.grid("cfg")
    assert grid["lr"] == pytest.approx([0.001, 0.01, 0.1]) and grid["width"] == [4, 5, 6]
    assert grid["opt.momentum"] == [0.0, 0.9]
    filled = plan.trial_config({"lr": 0.01, "opt.momentum": 0.5, "width": 5, "act": "tanh"})
    assert filled["hyperparameters"]["opt"] == {"kind": "sgd", "momentum": 0.5}
    assert filled["hyperparameters"]["fixed"] == 7 and "searcher" not in filled
    assert filled["max_length"] == {"batches": 10}
    (tmp_path / "trial.yaml").write_text(yaml.safe_dump(filled))
    assert load_config(tmp_path / "trial.yaml").hyperparameters["width"] == 5  # a plain dtrain run config


@pytest.mark.parametrize(("overrides", "fragment"), [
    ({"searcher": {**ASHA, "metirc": "mse"}}, "unknown key 'searcher.metirc'; did you mean 'searcher.metric'?"),
    ({"hyperparameters.lr": {"type": "double", "minval": 0, "maxvall": 1}},
     "unknown key 'hyperparameters.lr.maxvall'; did you mean 'hyperparameters.lr.maxval'?"),
    ({"hyperparameters.lr": {"type": "doubel", "minval": 0, "maxval": 1}}, "did you mean 'double'?"),
    ({"hyperparameters.lr": {"type": "int", "minval": 3}}, "type int needs 'maxval'"),
    ({"hyperparameters.lr": {"type": "double", "minval": 2, "maxval": 1}}, "minval 2.0 is above maxval 1.0"),
    ({"hyperparameters.lr": {"type": "categorical", "vals": [{"a": 1}]}}, "categorical vals must be numbers"),
    ({"hyperparameters.lr": {"type": "log", "minval": -3, "maxval": -1, "base": 1}}, "base 1 gives the same"),
    ({"searcher": {"name": "random", "metric": "mse"}}, "searcher.max_trials is required"),
    ({"checkpoint_storage.path": "/tmp/shared"}, "every trial would write its checkpoints to the same place"),
    ({"searcher": {"name": "hyperband", "metric": "mse"}}, "searcher.name"),
    ({"searcher": {"name": "grid", "metric": "mse"},
      "hyperparameters.lr": {"type": "double", "minval": 0, "maxval": 1}}, "grid search needs 'count'"),
])
def test_schema_errors(tmp_path, overrides, fragment):
    overrides = dict(overrides)
    searcher = overrides.pop("searcher", ASHA)
    with pytest.raises(ConfigError) as info:
        load_plan(search_config(tmp_path, searcher, **overrides))
    assert fragment in str(info.value)


def test_run_refuses_ranges_and_search_needs_a_searcher(tmp_path, capsys):
    cfg = tiny_config(tmp_path, **{"hyperparameters.lr": {"type": "double", "minval": 0, "maxval": 1}})
    with pytest.raises(ConfigError, match=r"hyperparameters\.lr is a search range; use dtrain search, or give a"):
        load_config(cfg)
    with pytest.raises(ConfigError, match="no 'searcher' section"):
        load_plan(cfg)
    assert main(["search"]) == 2
    assert "needs CONFIG" in capsys.readouterr().err
    assert main(["search", "--resume", str(tmp_path)]) == 2
    assert "not a search directory" in capsys.readouterr().err


def test_asha_rungs_shrink_to_fit(tmp_path):
    searcher = {**ASHA, "divisor": 3, "max_rungs": 5, "max_trials": 16}
    plan = load_plan(search_config(tmp_path, searcher, max_length={"epochs": 10}))
    assert plan.unit == "epochs" and plan.lengths == (1, 3, 10)
    assert "using 3 rung(s)" in plan.notes[0]


def test_rungs_end_where_determined_ends_them(tmp_path):
    """Rung k of r ends at max_length // divisor^(r-1-k), as in Determined's adaptive_asha (not at
    first * divisor^k: 25, not 24)."""
    plan = load_plan(search_config(tmp_path, {**ASHA, "divisor": 4, "max_rungs": 3, "max_trials": 16},
                                   max_length={"batches": 100}))
    assert plan.lengths == (6, 25, 100) and plan.warnings == ()


# ------------------------------------------------------------------------------------------ searches


def _trials(out: Path) -> dict[int, dict]:
    return {t["trial"]: t for t in json.loads((out / "trials.json").read_text())["trials"]}


def test_a_grid_search_asks_each_point_once(tmp_path):
    """The grid's points, as the search asks for its trials (a sampler per trial number, as
    ``runner.Search._ask``); a search through trial processes end to end is the Determined search's test."""
    cfg = search_config(tmp_path, {"name": "grid", "metric": "mse"}, max_length={"batches": 4},
                        **{"hyperparameters.lr": {"type": "double", "minval": 0.0, "maxval": 0.05, "count": 2}})
    plan = load_plan(cfg)
    assert plan.max_trials == 2 and not plan.is_asha
    study = optuna.create_study(direction=plan.direction, pruner=plan.pruner())
    asked = []
    for number in range(plan.max_trials):
        study.sampler = plan.sampler(number)
        trial = study.ask(plan.space.distributions())
        asked.append(trial.params["lr"])
        study.tell(trial, 1.0)  # no study.stop() after the last point (only possible inside study.optimize)
    assert sorted(asked) == [0.0, 0.05]


def _search_processes(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def _interrupt_when(proc: subprocess.Popen, ready: Path, timeout: float) -> tuple[str, str]:
    """Ctrl-C ``proc`` (SIGINT to the search only: its trials run in sessions of their own) once ``ready``
    exists; return its output. Kills everything it started if it hangs."""
    try:
        deadline = time.monotonic() + timeout
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_asha_search_stops_early_and_resumes_after_ctrl_c(tmp_path):
    """One slot, two trials, rungs at 4 and 8 batches. Seed 3 draws lr 0.0 (the best) for trial 0 and 0.05
    for trial 1: trial 0 is promoted and continues from its checkpoint to 8 batches; trial 1 is interrupted
    by Ctrl-C after its first checkpoint, continued by --resume, and stopped at the first rung.

    Until the interrupt, trial 1 waits in its third batch for a stop request: the interrupt always finds it
    mid-run, however loaded the machine is."""
    hold = tmp_path / "hold"
    hold.touch()
    cfg = search_config(tmp_path, {**ASHA, "max_trials": 2}, max_length={"batches": 8}, seed=3,
                        min_checkpoint_period={"batches": 1},
                        **{"hyperparameters.lr": {"type": "categorical", "vals": [0.0, 0.05]},
                           "hyperparameters.hold_at_batch": 2, "hyperparameters.hold_lr": 0.05,
                           "hyperparameters.hold_file": str(hold)})
    out = tmp_path / "search"
    # Ctrl-C's default action in the search whatever started the suite: a shell running it as a background
    # job (`make test &`) leaves SIGINT ignored in every process it starts, and Python keeps it ignored.
    proc = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "search", str(cfg), "--slots", "1", "--out",
                             str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    stdout, stderr = _interrupt_when(proc, out / "trials" / "1" / "checkpoints" / "latest", timeout=120)
    assert proc.returncode == 130, stdout + stderr
    assert f"continue with: dtrain search --resume {out}" in stderr
    assert "trial 0 promoted to 8 batches" in stdout
    assert "trial 0 continues from its checkpoint to 8 batches" in stdout and "trial 0 completed" in stdout
    assert not _search_processes(str(out)), "a trial process outlived the interrupted search"
    promoted = out / "trials" / "0"
    assert list(promoted.glob("config.before-resume-*.yaml"))  # its second segment was a dtrain run --resume
    validations = [json.loads(ln)["batches"] for ln in (promoted / "metrics.jsonl").read_text().splitlines()
                   if json.loads(ln)["kind"] == "validation"]
    assert validations == [4, 8]  # rung 1 then the rest: trained once, not from scratch again
    before = (promoted / "metrics.jsonl").read_bytes()
    hold.unlink()

    result = cli_in_process("search", "--resume", str(out))
    assert result.code == 0, result.stdout + result.stderr
    assert "1 finished trial(s) kept, 1 interrupted trial(s) continue" in result.stdout
    assert "trial 1 continues from its checkpoint to 4 batches" in result.stdout
    assert "dtrain search: trial 0 " not in result.stdout  # no event about trial 0: finished, kept as it was
    assert (promoted / "metrics.jsonl").read_bytes() == before
    trials = _trials(out)
    assert [trials[n]["hyperparameters"]["lr"] for n in (0, 1)] == [0.0, 0.05]
    assert trials[0]["state"] == "completed" and trials[0]["batches"] == 8
    assert trials[1]["state"] == "stopped" and trials[1]["batches"] == 4  # stopped early by ASHA
    assert json.loads((out / "trials.json").read_text())["total_batches"] == 12
    assert yaml.safe_load((out / "best.yaml").read_text())["hyperparameters"]["lr"] == 0.0


# -------------------------------------------------------------------- a search too small for its rungs

TOO_FEW = ("searcher: max_trials 4 is too few for adaptive_asha's 5 rungs with divisor 4: keeping the best 1/4 at "
           "each rung needs at least 256 trials (4^4); using 2 rung(s), as Determined does; raise searcher.max_trials "
           "to 256 for 5 rungs")


def test_asha_uses_the_rungs_max_trials_can_select_at_and_says_so(tmp_path, monkeypatch, capsys):
    searcher = {**ASHA, "max_trials": 4, "max_rungs": 5, "divisor": 4}
    plan = load_plan(search_config(tmp_path, searcher, max_length={"batches": 1024}))
    assert plan.lengths == (256, 1024) and plan.warnings == (TOO_FEW,)
    enough = load_plan(search_config(tmp_path, {**searcher, "max_trials": 256}, max_length={"batches": 1024}))
    assert enough.warnings == () and enough.lengths == (4, 16, 64, 256, 1024)
    assert load_plan(search_config(tmp_path, ASHA)).warnings == ()
    assert load_plan(ROOT / "examples" / "digits" / "search.yaml").warnings == ()  # 16 trials, 3 rungs of 3
    # Said when the search starts (no trial runs here).
    monkeypatch.setattr(runner.Search, "run", lambda self, progress: None)
    runner.run_search(search_config(tmp_path, searcher, max_length={"batches": 1024}), tmp_path / "s", None, 1, [])
    assert f"dtrain search: warning: {TOO_FEW}\n" in capsys.readouterr().err


@pytest.mark.parametrize("divisor", [2, 3, 4, 5])
def test_the_warning_asks_exactly_for_divisor_to_the_rungs_less_one(divisor):
    for rungs in range(1, 6):
        for trials in range(1, divisor ** 5 + 2):
            searcher = SearcherConfig(name="adaptive_asha", metric="m", max_trials=trials, divisor=divisor,
                                      max_rungs=rungs)
            length = Length(batches=divisor ** 6)
            warning = asha.too_few_trials(searcher, length)
            needed = divisor ** (rungs - 1)
            assert (warning is not None) == (trials < needed), (divisor, rungs, trials)
            fits = asha.rungs_for(divisor, trials)  # the most rungs these trials select at
            used = len(asha.rung_lengths(searcher, length)[1])
            assert used == min(rungs, fits), (divisor, rungs, trials)
            if warning is not None:
                assert f"raise searcher.max_trials to {needed} for {rungs} rungs" in warning
                assert divisor ** (fits - 1) <= trials < divisor ** fits and fits < rungs
                assert f"using {fits} rung(s)" in warning


def test_promotions_are_optunas_successive_halving(tmp_path):
    """What the warning describes, on the plan's own pruner (no trial runs): the first trial to finish a rung
    goes on however poor it is; once a rung has `divisor` results, a trial outside their best 1/divisor
    stops."""
    plan = load_plan(search_config(tmp_path, {**ASHA, "max_trials": 16, "max_rungs": 3, "divisor": 4},
                                   max_length={"batches": 16}))
    assert plan.lengths == (1, 4, 16)
    study = optuna.create_study(direction=plan.direction, pruner=plan.pruner())

    def rungs_passed(mse):
        trial = study.ask()
        for length in plan.lengths[:-1]:
            trial.report(mse, length)
            if trial.should_prune():
                return length
        return plan.lengths[-1]

    assert rungs_passed(1e9) == 16  # alone at every rung: promoted through all of them
    assert [rungs_passed(0.1) for _ in range(3)] == [16, 16, 16]  # each the best so far
    assert rungs_passed(5.0) == 1  # 5 results at rung 1: only the best one goes on


def test_rungs_of_a_huge_max_rungs_are_found_at_once(tmp_path):
    plan = load_plan(search_config(tmp_path, {**ASHA, "max_rungs": 10**9, "max_trials": 16},
                                   max_length={"batches": 10}))
    assert plan.lengths == (1, 2, 5, 10) and "using 4 rung(s)" in plan.notes[0]


def test_gpu_slots_are_the_devices_the_search_was_given(monkeypatch):
    from dtrain.search.procs import SlotPool

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,7")  # an allocation's GPUs, as Slurm hands them over
    pool = SlotPool(2, 1, gpus=True)
    assert pool.env([1])["CUDA_VISIBLE_DEVICES"] == "7" and pool.env([0, 1])["CUDA_VISIBLE_DEVICES"] == "4,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert SlotPool(2, 1, gpus=True).env([1])["CUDA_VISIBLE_DEVICES"] == "1"
