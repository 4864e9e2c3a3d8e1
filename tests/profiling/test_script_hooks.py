"""A script's steps found from outside (dtrain.profiling.script.hooks), in one process: what a step is (an
optimizer step after a backward, nested inside ``step(closure)``, one per accumulation, one where GradScaler
skips), that validation is not one, DDP's facts in a gloo world of one, and that a failing hook stops
profiling and never the script."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dtrain.profiling.phases import PHASES
from dtrain.profiling.script import hooks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def prof() -> Iterator[hooks.ScriptProfiler]:
    profiler = hooks.ScriptProfiler(warmup_steps=1)
    hooks.install(profiler)
    try:
        yield profiler
    finally:
        hooks.uninstall()


def _loader(batch: int = 8, n: int = 256) -> DataLoader:
    data = TensorDataset(torch.randn(n, 4), torch.randn(n, 1))
    return DataLoader(data, batch_size=batch)


def _phases(prof: hooks.ScriptProfiler) -> dict[str, float]:
    assert prof.timer is not None
    return prof.timer.per_step()


def test_a_step_ends_at_the_optimizer_step_after_a_backward(prof: hooks.ScriptProfiler) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(_loader()):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i == 9:
            break
    opt.step()  # a step without a backward: not a step of its own
    assert prof.timer is not None and prof.timer.steps == 10
    assert prof.loader.batch_size == 8 and prof.loader.iterators == 1
    per_step = _phases(prof)
    # The phases partition the step (the step's edges run from its start to its end).
    assert sum(per_step[p] for p in PHASES) == pytest.approx(per_step["step"], rel=1e-6)
    assert per_step["data"] > 0 and per_step["forward"] > 0 and per_step["backward"] > 0
    assert prof.backwards == 10 and prof.exchanges == 0


def test_forward_and_backward_nested_in_step_closure_are_one_step(prof: hooks.ScriptProfiler) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=1)
    batches = iter(_loader())
    for _ in range(6):
        x, y = next(batches)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    assert prof.timer is not None and prof.timer.steps == 6
    per_step = _phases(prof)
    assert per_step["forward"] > 0 and per_step["backward"] > 0 and per_step["optimizer"] > 0


def test_accumulation_is_one_step_per_optimizer_step(prof: hooks.ScriptProfiler) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = iter(_loader(batch=4))
    for _ in range(5):
        for _ in range(3):
            x, y = next(batches)
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert prof.timer is not None and prof.timer.steps == 5
    assert prof.backwards / prof.timer.steps == 3


def test_validation_between_steps_is_not_a_step(prof: hooks.ScriptProfiler) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    val = _loader(n=32)
    pause = 0.05
    batches = iter(_loader())
    for i in range(8):
        x, y = next(batches)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i % 2 == 1:
            with torch.no_grad():
                for vx, _ in val:
                    model(vx)
                time.sleep(pause)
    assert prof.timer is not None and prof.timer.steps == 8
    assert prof.validation_seconds >= 3 * pause  # the last pass has no training batch after it
    assert _phases(prof)["step"] < pause  # the evaluation is left out of the steps after it


def test_a_step_the_grad_scaler_skips_still_counts(prof: hooks.ScriptProfiler) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    ran = []
    opt.register_step_post_hook(lambda *_: ran.append(1))
    for i, (x, y) in enumerate(_loader()):
        loss = nn.functional.mse_loss(model(x), y) * (float("inf") if i % 2 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if i == 5:
            break
    assert len(ran) < 6  # the scaler skipped some optimizer steps
    assert prof.timer is not None and prof.timer.steps == 6 and prof.grad_scaler


def test_ddp_found_with_its_settings_and_no_sync_accumulation(prof: hooks.ScriptProfiler, world_of_one: None) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    ddp = DistributedDataParallel(model, bucket_cap_mb=5, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    batches = iter(_loader(batch=4))
    for _ in range(6):
        for micro in range(2):
            x, y = next(batches)
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    (found, cap), = prof.live_ddps()
    assert found is ddp and cap == 5.0
    assert prof.timer is not None and prof.timer.steps == 6
    assert prof.no_sync and prof.backwards == 12 and prof.exchanges == 6

    from dtrain.profiling.script.merge import build_records, rank_payload

    payload = rank_payload(prof, 0, 1, 1.0)
    record, summary, script = build_records(
        [payload], {"launcher": "test", "command": ["t.py"], "cwd": ".", "script": __file__}, complete=True)
    assert record is not None and summary is not None
    model_facts, = script.models
    assert model_facts.bucket_cap_mb == 5.0 and model_facts.find_unused_parameters
    assert model_facts.parameters == sum(p.numel() for p in model.parameters())
    assert script.micro_batches_per_step == 2 and script.exchanges_per_step == 1 and script.no_sync
    assert record.aggregation_frequency == 2 and record.per_slot_batch_size == 4 and not record.probes
    assert record.script == script and summary.steps == 6


def test_a_failing_hook_stops_profiling_not_the_script(prof: hooks.ScriptProfiler,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = iter(_loader())
    x, y = next(batches)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert prof.timer is not None

    def broken(*_: object) -> None:
        raise ValueError("planted")

    prof.timer.lap = broken  # type: ignore[method-assign]
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        x, y = next(batches)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert not prof.on
    assert any("profiling stopped" in r.getMessage() for r in caplog.records)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # it trained on


def test_the_pth_file_and_its_environment_name() -> None:
    from dtrain import profile
    from dtrain.engine import scriptprof

    assert profile.ENV == scriptprof.ENV
    line = (ROOT / "src" / "dtrain-profile.pth").read_text()
    assert line.startswith("import os;") and "DTRAIN_PROFILE" in line and "from_environment" in line
    installed = Path(torch.__file__).parents[1] / "dtrain-profile.pth"  # site-packages, beside torch
    assert installed.read_text() == line, "reinstall dtrain (pip install -e .): its .pth file is missing or stale"


def test_every_rank_names_the_same_default_run_directory() -> None:
    from dtrain.profile import default_run_dir

    env = {"TORCHELASTIC_RUN_ID": "abc123", "RANK": "0"}
    assert default_run_dir("x/train.py", env) == default_run_dir("x/train.py", {**env, "RANK": "1"})
    assert default_run_dir("x/train.py", env) == Path("runs/train-abc123")


@pytest.mark.parametrize(("argv", "says"), [
    ([], "usage: python -m dtrain.profile"),
    (["--run-dir"], "--run-dir needs a directory"),
    (["nope.py"], "script 'nope.py' does not exist"),
])
def test_profile_module_bad_input_is_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dtrain import profile

    with pytest.raises(SystemExit) as exited:
        profile.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err


def test_stop_after_steps_ends_the_script_after_that_step() -> None:
    profiler = hooks.ScriptProfiler(warmup_steps=1, stop_after=4)
    hooks.install(profiler)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    done = 0
    try:
        with pytest.raises(hooks.StepsDone) as stopped:
            for x, y in _loader():
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                done += 1
    finally:
        hooks.uninstall()
    assert stopped.value.code == 0 and done == 3  # the fourth step applied, then the script unwound
    assert profiler.timer is not None and profiler.timer.steps == 4
