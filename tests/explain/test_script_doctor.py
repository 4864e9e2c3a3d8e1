"""Planted bottlenecks in a plain DDP script, named by the doctor from real 2-rank runs (issue 72, parts 4 and 5):
each planted case runs once (a module fixture), every rank stopped together after a few steps by
``DTRAIN_PROFILE_STEPS``, and several tests read its run directory. ``--verify`` on the slow loader runs the
script again with the doctor's change from outside and measures it against a baseline (one round, few steps)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, cli_in_process

from dtrain.explain.doctor import diagnose
from dtrain.explain.predictor import Predictor
from dtrain.explain.scriptverify import NOT_SANDBOXED
from dtrain.profiling.record import ProfileRecord, load_run_profile

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PLAIN = ROOT / "examples" / "scripts" / "ddp_plain.py"
STEPS = 12
# ddp_plain.py --many-tensors: 40 x Linear(32, 32), then Linear(32, 10); fp32 gradients.
MANY_TENSORS = 40 * 2 + 2
MANY_TENSORS_BYTES = 4 * (40 * (32 * 32 + 32) + 32 * 10 + 10)


def _launch(run_dir: Path, *args: str) -> Path:
    """The plain script on 2 slots, its --steps far beyond STEPS: every rank stops after STEPS optimizer steps."""
    os.environ["DTRAIN_PROFILE_STEPS"] = str(STEPS)
    try:
        result = cli_in_process("launch", "--slots", "2", "--run-dir", str(run_dir), str(PLAIN), "--steps", "400",
                                *args)
    finally:
        os.environ.pop("DTRAIN_PROFILE_STEPS", None)
    assert result.code == 0, result.stderr
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    folder = tmp_path_factory.mktemp("planted")
    yield {
        # A slow loader (no workers), and accumulation that all-reduces on every micro-batch (no no_sync).
        "slow": _launch(folder / "slow", "--slow-loader", "0.001", "--accumulate", "2"),
        # A loader whose one worker starts again every epoch (4 steps each), and DDP searching for unused
        # parameters on a model that uses every one.
        "epochs": _launch(folder / "epochs", "--workers", "1", "--samples", "256", "--find-unused"),
        # Many small gradient tensors (41 small layers): DDP fuses them, so the exchange is a few messages.
        "tensors": _launch(folder / "tensors", "--many-tensors"),
    }


def _record(run_dir: Path) -> ProfileRecord:
    record = load_run_profile(run_dir)
    assert record.script is not None and record.script.ranks_reported == [0, 1]
    assert record.steps == STEPS  # every rank stopped after the same step
    return record


def _line(site: str) -> str:
    path, _, line = site.rpartition(":")
    assert path == str(PLAIN)
    return PLAIN.read_text().splitlines()[int(line) - 1]


def test_the_slow_loader_and_the_exchange_on_every_micro_batch_are_named(runs: dict[str, Path]) -> None:
    record = _record(runs["slow"])
    assert record.comm.latency_seconds > 0  # probed where every rank stopped, as at destroy_process_group()
    diagnosis = diagnose(record)
    assert diagnosis.top_factor == "data_loading"
    assert diagnosis.script_tries and diagnosis.script_tries[0][0].startswith("loader.num_workers=")
    (found,) = [f for f in diagnosis.script_findings if f.name == "no_sync"]
    assert found.seconds is not None and found.seconds > 0  # half the exposed exchange: one of two per step
    assert found.seconds == pytest.approx(record.comm.exposed_seconds_per_step / 2)
    assert record.script is not None
    assert "backward()" in _line(record.script.sites["backward"])
    assert "DistributedDataParallel(" in _line(record.script.sites["ddp"])
    assert "DataLoader(" in _line(record.script.sites["loader"])


def test_many_small_gradient_tensors_are_counted_and_priced_as_the_exchange(runs: dict[str, Path]) -> None:
    record = _record(runs["tensors"])
    assert record.gradient_bytes is not None and len(record.gradient_bytes[0]) == MANY_TENSORS
    assert sum(record.gradient_bytes[0]) == MANY_TENSORS_BYTES == record.comm.bytes_per_step
    assert record.comm.exposed_seconds_per_step > 0 and record.comm.latency_seconds > 0
    diagnosis = diagnose(record)
    # Priced as the exchange: the cost model's exchange term at the run (a message per bucket, bytes over the link).
    # How the table splits the run's step between the exchange's rows and the straggler row follows the ranks'
    # measured waits, which the machine's load moves (seen once in CI: the communication row at 0), and so does
    # what to try for it.
    assert Predictor(record).base.parts["exchange"] > 0
    assert {"communication", "sync_frequency"} <= {f.factor for f in diagnosis.factors}


def test_workers_started_every_epoch_and_an_idle_unused_parameter_search(runs: dict[str, Path]) -> None:
    record = _record(runs["epochs"])
    assert record.script is not None and record.script.loader is not None
    assert record.script.loader.iterators == 3 and len(record.script.loader.first_batch_seconds) == 2
    assert record.script.models[0].unused_parameter_bytes == 0
    found = {f.name: f for f in diagnose(record).script_findings}
    assert set(found) == {"loader_restarts", "find_unused_parameters"}
    restart = found["loader_restarts"]
    assert restart.per == "epoch" and restart.seconds is not None and restart.seconds > 0
    assert "persistent_workers=True" in restart.fix and record.script.sites["loader"] in restart.fix
    assert "DataLoader(" in _line(record.script.sites["loader"])


def test_verify_measures_the_slow_loaders_advice(runs: dict[str, Path]) -> None:
    run_dir = runs["slow"]
    result = cli_in_process("doctor", str(run_dir), "--verify", "--repeats", "1", "--steps", "10", "--json")
    assert result.code == 0, result.stderr
    assert result.stderr.count(NOT_SANDBOXED) == 1
    doc = json.loads(result.stdout)
    (row,) = [r for r in doc["tried"] if r["try"].startswith("loader.num_workers=")]
    # The planted loader sleeps per sample; loader processes hide it behind the step.
    assert row["measured_speedup"] > 1.3
    session = Path(doc["session_dir"])
    assert session.parent == run_dir and doc["rounds"] == 1
    tried = [load_run_profile(p) for p in sorted(session.iterdir()) if (p / "profile.json").is_file()]
    # The recorded command, then once with each change the doctor tried (which ones depends on the measured run).
    overrides = [t.script.overrides if t.script else None for t in tried]
    assert overrides[0] == [] and sorted(overrides[1:]) == sorted([r["try"]] for r in doc["tried"])
    assert all(t.steps == doc["steps"] for t in tried)  # every rank stopped after --steps


def test_try_on_the_run_names_edits_and_refuses_bad_keys(runs: dict[str, Path]) -> None:
    good = cli_in_process("doctor", str(runs["slow"]), "--try", "slots=4", "--try", "precision=bf16-mixed")
    assert good.code == 0, good.stderr
    assert "the global batch changes with the slots" in good.stdout
    assert f"{PLAIN}:" in good.stdout.split("try precision=bf16-mixed:")[1]
    bad = cli_in_process("doctor", str(runs["slow"]), "--try", "data_loader.num_workers=2")
    assert bad.code == 2 and bad.stderr.count("\n") == 1 and "loader.num_workers" in bad.stderr
