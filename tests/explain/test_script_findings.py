"""What only a script shows, and the doctor on a script's run, in one process (issue 72, parts 4 and 5): findings
with their measured cost and the line to change, from a script's record (built by the hooks and the merge in a
gloo world of one, then changed by hand); ``--try`` on a script's run; ``--verify``'s refusals; ``dtrain compare
RUN_A RUN_B``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import cli_in_process
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dtrain.errors import UserError
from dtrain.explain import compare, scriptadvice, scriptverify
from dtrain.explain.doctor import diagnose, render
from dtrain.profiling.record import ProfileRecord, write_profile
from dtrain.profiling.script import hooks
from dtrain.profiling.script.findings import findings
from dtrain.profiling.script.merge import build_records, rank_payload, script_sha256


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProfileRecord]:
    """A real script record: DDP in a gloo world of one, a DataLoader, SGD, steps found by the hooks."""
    folder = tmp_path_factory.mktemp("base")
    script = folder / "train.py"
    script.write_text("# the script\n")
    dist.init_process_group("gloo", init_method=f"file://{folder / 'rdzv'}", rank=0, world_size=1)
    prof = hooks.ScriptProfiler(warmup_steps=1)
    hooks.install(prof)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for i, (x, y) in enumerate(DataLoader(TensorDataset(torch.randn(96, 8), torch.randn(96, 1)), batch_size=8)):
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i == 9:
                break
        payload = rank_payload(prof, 0, 1, 1.0)
    finally:
        hooks.uninstall()
        dist.destroy_process_group()
    info = {"launcher": "dtrain launch", "command": [str(script)], "cwd": str(folder), "script": str(script)}
    record, _, _ = build_records([payload], info, complete=True)
    assert record is not None and record.script is not None
    yield record


def _with(record: ProfileRecord, top: dict[str, Any] | None = None, **script: Any) -> ProfileRecord:
    """``record`` with its head (``top``) and script section changed (nested sections by ``model_copy``)."""
    assert record.script is not None
    return record.model_copy(update={**(top or {}), "script": record.script.model_copy(update=script)})


def _model(record: ProfileRecord, **changes: Any) -> Any:
    assert record.script is not None
    return record.script.models[0].model_copy(update=changes)


def _phases(record: ProfileRecord, **means: float) -> Any:
    spread = record.seconds_per_step
    return spread.model_copy(update={k: getattr(spread, k).model_copy(update={"mean": v}) for k, v in means.items()})


def test_a_plain_run_has_no_findings(base: ProfileRecord) -> None:
    assert findings(base) == []
    assert base.script is not None and set(base.script.sites) >= {"loader", "optimizer", "ddp", "backward"}
    assert all(site.startswith(f"{__file__}:") for site in base.script.sites.values())


def test_an_all_reduce_on_every_micro_batch_is_priced_from_the_exposed_exchange(base: ProfileRecord) -> None:
    comm = base.comm.model_copy(update={"exposed_seconds_per_step": 0.004, "busy_seconds_per_step": 0.006})
    record = _with(base, {"slots": 2, "comm": comm}, micro_batches_per_step=4.0, exchanges_per_step=4.0)
    (found,) = findings(record)
    assert found.name == "no_sync" and found.per == "step"
    assert found.seconds == pytest.approx(0.003)  # three of four exchanges' exposed time
    assert "no_sync()" in found.fix and base.script is not None and base.script.sites["backward"] in found.fix
    # Under no_sync (one exchange per step) nothing is found.
    assert findings(_with(record, micro_batches_per_step=4.0, exchanges_per_step=1.0)) == []


def test_find_unused_parameters_on_a_model_that_used_every_one(base: ProfileRecord) -> None:
    record = _with(base, models=[_model(base, find_unused_parameters=True, unused_parameter_bytes=0)])
    (found,) = findings(record)
    assert found.name == "find_unused_parameters" and found.seconds is None  # not separable: said, not guessed
    assert found.verify == "ddp.static_graph=true" and "not separable" in found.cost
    assert findings(_with(base, models=[_model(base, find_unused_parameters=True, unused_parameter_bytes=20)])) == []
    assert findings(_with(base, models=[_model(base, find_unused_parameters=True, unused_parameter_bytes=0,
                                                static_graph=True)])) == []


def test_host_syncs_every_step_on_cuda_only(base: ProfileRecord) -> None:
    (found,) = findings(_with(base, {"device": "cuda"}, host_syncs_per_step=2.0))
    assert found.name == "host_syncs" and found.seen.startswith("2 host synchronization(s) per step")
    assert findings(_with(base, host_syncs_per_step=2.0)) == []  # a CPU run: no such thing
    assert findings(_with(base, {"device": "cuda"}, host_syncs_per_step=None)) == []


def test_loader_workers_restarted_every_epoch_are_priced_per_epoch(base: ProfileRecord) -> None:
    assert base.script is not None and base.script.loader is not None
    phases = _phases(base, data=0.010, other=0.002)
    loader = base.script.loader.model_copy(update={"num_workers": 2, "iterators": 3,
                                                   "first_batch_seconds": [0.50, 0.60]})
    (found,) = findings(_with(base, {"seconds_per_step": phases}, loader=loader))
    assert found.name == "loader_restarts" and found.per == "epoch"
    assert found.seconds == pytest.approx(0.55 - 0.012)
    assert "persistent_workers=True" in found.fix and found.verify == "loader.persistent_workers=true"
    kept = loader.model_copy(update={"persistent_workers": True})
    assert findings(_with(base, {"seconds_per_step": phases}, loader=kept)) == []


def test_the_doctor_shows_findings_and_changes_to_try_from_outside(base: ProfileRecord) -> None:
    assert base.script is not None and base.script.loader is not None
    slow = _phases(base, data=0.080, forward=0.002, backward=0.002, step=0.090)
    loader = base.script.loader.model_copy(update={"num_workers": 1, "iterators": 3, "first_batch_seconds": [0.5]})
    record = _with(base, {"seconds_per_step": slow}, loader=loader,
                   models=[_model(base, find_unused_parameters=True, unused_parameter_bytes=0)])
    diagnosis = diagnose(record)
    assert {f.name for f in diagnosis.script_findings} == {"loader_restarts", "find_unused_parameters"}
    tries = [item for item, _ in diagnosis.script_tries]
    assert "loader.persistent_workers=true" in tries and "ddp.static_graph=true" in tries
    text = render(diagnosis)
    assert "fix: " in text and "--try loader.persistent_workers=true" in text
    doc = diagnosis.to_json()
    assert {f["name"] for f in doc["script_findings"]} == {"loader_restarts", "find_unused_parameters"}
    # A Trial's run has none of this.
    assert "script_findings" not in diagnose(base.model_copy(update={"script": None})).to_json()


def test_try_on_a_script_run_has_no_point_figure_and_names_why(base: ProfileRecord) -> None:
    workers = scriptadvice.try_one(base, "loader.num_workers=4")
    assert workers.gain is None and workers.value == 4 and "measure it with --verify" in (workers.reason or "")
    assert scriptadvice.refusal(workers) is None  # --verify can run it
    slots = scriptadvice.try_one(base, "slots=4")
    assert "the global batch changes with the slots" in (slots.reason or "") and scriptadvice.refusal(slots) is None
    edit = scriptadvice.try_one(base, "precision=bf16-mixed")
    assert base.script is not None and base.script.sites["backward"] in (edit.reason or "")
    assert scriptadvice.refusal(edit) is not None  # only an edit makes it: --verify cannot
    hooked = _with(base, models=[_model(base, comm_hook="fp16_compress_hook")])
    own = scriptadvice.try_one(hooked, "ddp.comm_hook=powersgd")
    assert "fp16_compress_hook" in (own.reason or "") and "not replaced" in (own.reason or "")
    spawned = scriptadvice.try_one(_with(base, launcher="DTRAIN_PROFILE"), "slots=4")
    assert "fixes the slot count" in (spawned.reason or "") and scriptadvice.refusal(spawned) is not None
    with pytest.raises(UserError, match=r"a script run has no key 'optimizations\.tensor_fusion_threshold'"):
        scriptadvice.try_one(base, "optimizations.tensor_fusion_threshold=50")


def _run_dir(folder: Path, record: ProfileRecord) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_profile(folder / "profile.json", record)
    assert record.script is not None
    (folder / "script.json").write_text(record.script.model_dump_json())
    return folder


def test_verify_refuses_a_changed_script_in_one_line(base: ProfileRecord, tmp_path: Path) -> None:
    assert base.script is not None
    script = tmp_path / "train.py"
    script.write_text("print('edited')\n")
    record = _with(base, script=str(script), script_sha256=script_sha256(script))
    run = _run_dir(tmp_path / "run", record)
    assert scriptverify.is_script_run(run)
    script.write_text("print('edited again')\n")
    with pytest.raises(UserError, match="changed since the run"):
        scriptverify.open_script(run, ["loader.num_workers=2"], 10, 1, None, 0.1, print)
    script.write_text("print('edited')\n")
    with pytest.raises(UserError, match="only by an edit of the script"):
        scriptverify.open_script(run, ["precision=bf16-mixed"], 10, 1, None, 0.1, print)
    lines: list[str] = []
    session, experiments = scriptverify.open_script(run, ["tf32=true"], 10, 1, None, 0.1, lines.append)
    assert [e.sets for e in experiments] == [[], ["tf32=true"]] and session.steps >= 10
    assert scriptverify.NOT_SANDBOXED in lines  # said once, before anything runs


def test_compare_two_runs_side_by_side(base: ProfileRecord, tmp_path: Path) -> None:
    a = _run_dir(tmp_path / "a", base)
    faster = base.model_copy(update={"samples_per_second": 2 * base.samples_per_second})
    b = _run_dir(tmp_path / "b", faster)
    result = compare.compare_runs(a, b)
    assert result["speedup"] == pytest.approx(2.0)
    text = compare.render_runs(result)
    for label in ("samples/s", "step ms", "data ms", "comm_exposed ms", "all-reduced MB/step", "top factor"):
        assert label in text
    assert "2.00x" in text and "the same script" in text
    as_json = cli_in_process("compare", str(a), str(b), "--json")
    assert as_json.code == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["speedup"] == pytest.approx(2.0) and doc["a"]["run_dir"] == str(a) and doc["b"]["top_factor"]


@pytest.mark.parametrize(("paths", "says"), [(["x", "y", "z"], "got 3 paths"), (["a", "missing"], "not a run")])
def test_compare_with_bad_paths_is_one_line(tmp_path: Path, paths: list[str], says: str) -> None:
    (tmp_path / "a").mkdir()

    import argparse

    with pytest.raises(UserError, match=says):
        compare.cmd_compare(argparse.Namespace(config=[tmp_path / p for p in paths]))


def test_a_verify_run_is_the_recorded_command_with_the_change(base: ProfileRecord, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The short run's plumbing, its launcher stood in for: the recorded command and working directory, the slots
    a change asks for, the steps and the overrides in the environment, all undone afterwards."""
    import os

    from dtrain.explain.verify import Experiment
    from dtrain.launcher import agent, forkstart
    from dtrain.profiling.script.overrides import ENV, from_env

    assert base.script is not None
    seen: dict[str, Any] = {}

    def launch(command: forkstart.WorkerModule, options: agent.LaunchOptions) -> None:
        seen.update(command=command, slots=options.slots, cwd=os.getcwd(), steps=os.environ["DTRAIN_PROFILE_STEPS"],
                    overrides=from_env(os.environ), out=os.environ["DTRAIN_PROFILE"])
        Path(os.environ["DTRAIN_PROFILE"]).mkdir(parents=True)  # as the script's profiling session does
        write_profile(Path(os.environ["DTRAIN_PROFILE"]) / "profile.json", base)

    monkeypatch.setattr(agent, "launch", launch)
    monkeypatch.delenv(ENV, raising=False)
    run = scriptverify._runner(base, 25, 1, False)
    out = tmp_path / "r0-01"
    sps = run(Experiment("slots=4", "try", ["slots=4", "loader.num_workers=2"]), out)
    assert sps == base.samples_per_second
    command = seen["command"]
    assert command.module == forkstart.SCRIPT_WORKER and list(command.argv) == base.script.command
    assert command.path[0] == base.script.cwd and seen["slots"] == 4  # the search path of `python -m` there
    assert seen["cwd"] == base.script.cwd and seen["steps"] == "25" and seen["out"] == str(out.resolve())
    assert seen["overrides"].num_workers == 2 and seen["overrides"].slots is None  # the launcher's, not the hooks'
    assert ENV not in os.environ and os.getcwd() != base.script.cwd
