"""Probes that can never hurt a run: a fault in any end-of-run probe on one rank of two skips that probe on both,
and the run exits 0 with all of its outputs (tests/trials/probefault.py plants the faults)."""

import json

import pytest
from helpers import PROBED, TRIALS, tiny_config, train

from dtrain.profiling.record import load_profile

# A hang in a probe would hold both ranks until this timeout and fail the run (exit 1): exit 0 says none did.
TIMEOUT = {"resources.collective_timeout_seconds": 30}
# A short run: the probes' own budget (their least) is what these runs spend most of their time in.
SHORT = {"max_length.batches": 8, "hyperparameters.train_size": 64, "hyperparameters.val_size": 0}


def _run(tmp_path, ok=True, probed=True, **hparams):
    config = tiny_config(tmp_path, entrypoint="probefault:ProbeFaultTrial", **(PROBED if probed else {}), **TIMEOUT,
                         **SHORT,
                         **{f"hyperparameters.{k}": v for k, v in hparams.items()})
    (tmp_path / "probefault.py").write_text((TRIALS / "probefault.py").read_text())
    run_dir = tmp_path / "run"
    result = train(config, run_dir, ok=False)
    if not ok:
        return run_dir, result
    assert result.code == 0, result.stderr
    assert "--resume" not in result.stdout + result.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8
    return run_dir, load_profile(run_dir / "profile.json")


def _skipped(profile):
    return {s.probe: s.reason for s in profile.probes_skipped}


def test_out_of_memory_at_twice_the_batch_on_one_rank_skips_that_probe_on_both(tmp_path, report_page):
    # The run: rank 0 cannot take a batch larger than the one it trained on.
    run_dir, profile = _run(tmp_path, oom_rank=0)
    skipped = _skipped(profile)
    assert skipped["batch_scaling"] == "rank 0: out of memory"  # rank 1 took it: only rank 0 is named
    assert profile.batch_scaling is None
    assert profile.model_steps is not None and profile.model_steps.double_batch_skipped == "out of memory"
    assert profile.comm_probe is not None and profile.comm_probe.points  # the probes after it still ran
    # The chief's one line (at WARNING: its console shows it, quiet or not), read from its log.
    line = [w for w in (run_dir / "logs" / "rank0.log").read_text().splitlines() if "end-of-run probes skipped" in w]
    assert len(line) == 1 and "WARNING" in line[0] and "batch_scaling: rank 0: out of memory" in line[0]
    assert (run_dir / "report.html").stat().st_size > 0


# Faults in every stage, each stage on the rank that runs it (the solo and model-step probes run on the first rank
# alone), in two runs: the stages of the saved state's probes and the link probe after them; the saved state itself.
STAGES = {"data_loading": 1, "batch_scaling": 1, "solo_probe": 0, "model_steps": 0, "data_crowded": 1,
          "restore": 0, "comm_probe": 1, "double_batch": 1}


@pytest.mark.parametrize("faults", [STAGES, {"batch_probe": 1}], ids=["every-stage", "saved-state"])
def test_a_fault_in_any_probe_on_one_rank_skips_it_on_every_rank(tmp_path, faults):
    _, profile = _run(tmp_path, faults=faults)
    skipped = _skipped(profile)
    assert set(skipped) == set(faults)
    for stage, rank in faults.items():
        assert skipped[stage] == f"rank {rank}: _Planted: planted fault in {stage}"
    if "comm_probe" not in faults:  # the link probe does not need the saved state
        assert profile.comm_probe is not None and profile.comm_probe.points
    assert profile.batch_scaling is None and profile.solo_probe is None and profile.model_steps is None
    assert profile.data_crowded_step_seconds is None and profile.data_load_seconds_per_batch is None


def test_a_batch_that_fails_inside_the_crowded_probes_exchange_costs_only_that_figure(tmp_path):
    # Rank 0's records fail its train_batch only when read by a loader process: inside a crowded probe step whose
    # gradient exchange rank 1 entered. Rank 0 trains that step on the probe's own batch, and no count is reported.
    run_dir, profile = _run(tmp_path, bad_worker_records_rank=0)
    assert "a loaded batch failed on this rank" in (run_dir / "logs" / "rank0.log").read_text()
    assert profile.data_crowded_step_seconds is None
    assert profile.batch_scaling is not None and profile.model_steps is not None
    assert profile.comm_probe is not None and profile.comm_probe.points


def test_a_run_that_fails_after_its_last_checkpoint_is_not_told_to_resume(tmp_path):
    # What is left to fail at the end (the end-of-run gather, probes or not) fails the run, but its training had
    # finished: --resume would refuse it, so the error does not advise it.
    run_dir, result = _run(tmp_path, ok=False, probed=False, faults={"gather": 1})
    assert result.code == 1 and "worker rank 1 failed" in result.stderr
    assert "--resume" not in result.stderr and "its training had finished" in result.stderr
    assert (run_dir / "checkpoints" / "8").is_dir()
