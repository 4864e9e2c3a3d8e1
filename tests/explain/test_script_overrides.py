"""Changes made to a script from outside (issue 72, part 4), in one process: the typed record and its one-line
errors, the hooks applying it to what the script builds (DataLoader, DDP, a comm hook unless the script has its
own), the construction sites recorded, and synchronizing calls counted per step (a fake on the CPU)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dtrain.errors import UserError
from dtrain.profiling.script import hooks, outside, overrides
from dtrain.profiling.script.overrides import Overrides


def test_keys_a_user_can_guess_parse_into_one_record() -> None:
    found = overrides.parse(["slots=4", "ddp.bucket_cap_mb=50", "ddp.comm_hook=FP16", "ddp.static_graph=true",
                             "loader.num_workers=4", "loader.pin_memory=true", "loader.persistent_workers=true",
                             "tf32=false"])
    assert found == Overrides(slots=4, bucket_cap_mb=50.0, comm_hook="fp16", static_graph=True, num_workers=4,
                              pin_memory=True, persistent_workers=True, tf32=False)
    assert found.spelled()[:2] == ["slots=4", "ddp.bucket_cap_mb=50"]
    # The hooks' part travels as JSON; the launcher's (slots) does not.
    back = overrides.from_env({overrides.ENV: found.to_env()})
    assert back == Overrides(**{**found.given(), "slots": None})


@pytest.mark.parametrize(("item", "says"), [
    ("ddp.buckets=5", "a script run has no key 'ddp.buckets'"),
    ("loader.num_workers=-1", "loader.num_workers takes a whole number from 0 to 256"),
    ("ddp.comm_hook=int8", "ddp.comm_hook takes one of none, fp16, bf16, powersgd"),
    ("tf32=yes", "tf32 takes true or false"),
    ("ddp.bucket_cap_mb=0", "megabytes above 0"),
    ("slots", "--try expects KEY=VALUE"),
    ("precision=bf16-mixed", "made by an edit of the script"),
])
def test_a_bad_key_or_value_is_one_line_listing_the_keys(item: str, says: str) -> None:
    with pytest.raises(UserError) as exc:
        overrides.parse([item])
    text = str(exc.value)
    assert says in text and "\n" not in text and exc.value.exit_code == 2
    if "no key" in says or "KEY=VALUE" in says:
        assert "loader.persistent_workers" in text  # the keys a script run accepts


def test_a_damaged_environment_record_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        assert overrides.from_env({overrides.ENV: '{"bogus": 1}'}) is None
    assert overrides.ENV in caplog.text
    assert overrides.from_env({}) is None


@pytest.fixture
def installed() -> Iterator[list[hooks.ScriptProfiler]]:
    made: list[hooks.ScriptProfiler] = []
    yield made
    hooks.uninstall()


def _install(made: list[hooks.ScriptProfiler], over: Overrides | None) -> hooks.ScriptProfiler:
    prof = hooks.ScriptProfiler(warmup_steps=1, overrides=over)
    hooks.install(prof)
    made.append(prof)
    return prof


def test_loader_overrides_are_applied_where_the_script_builds_it(installed: list[hooks.ScriptProfiler]) -> None:
    prof = _install(installed, Overrides(num_workers=0, pin_memory=False))
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = DataLoader(data, 8, False, num_workers=2, prefetch_factor=4, persistent_workers=True)  # line named
    # No workers: DataLoader refuses a prefetch factor and persistent workers without them, so both go too.
    assert loader.num_workers == 0 and loader.prefetch_factor is None and not loader.persistent_workers
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the optimizer's line
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    here = Path(__file__).read_text().splitlines()
    for key, text in (("optimizer", "the optimizer's line"), ("backward", "mse_loss(model(x), y).backward()")):
        path, _, line = prof.sites[key].rpartition(":")
        assert path == __file__ and text in here[int(line) - 1]
    assert prof.loader.site is not None and "line named" in here[int(prof.loader.site.rpartition(":")[2]) - 1]


def test_persistent_workers_are_kept_with_workers(installed: list[hooks.ScriptProfiler]) -> None:
    _install(installed, Overrides(num_workers=1, persistent_workers=True))
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    assert loader.num_workers == 1 and loader.persistent_workers


def _train(ddp: nn.Module, steps: int = 3) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(steps):
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_ddp_overrides_and_a_comm_hook_are_applied(installed: list[hooks.ScriptProfiler], world_of_one: None) -> None:
    from torch.nn.parallel import DistributedDataParallel

    prof = _install(installed, Overrides(bucket_cap_mb=1.0, static_graph=True, comm_hook="fp16"))
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)), bucket_cap_mb=25,
                                  find_unused_parameters=True)
    _train(ddp)
    assert ddp.bucket_bytes_cap == 1024 * 1024 and ddp.static_graph
    assert "fp16" in ddp._get_ddp_logging_data().get("comm_hook", "")
    assert prof.ddp_caps == [1.0]  # what ran is what the record says
    assert prof.sites["ddp"].startswith(f"{__file__}:")


def test_a_scripts_own_comm_hook_is_not_replaced(installed: list[hooks.ScriptProfiler], world_of_one: None,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    _install(installed, Overrides(comm_hook="powersgd"))
    ddp = DistributedDataParallel(nn.Linear(8, 1))
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        _train(ddp)
    assert "fp16" in ddp._get_ddp_logging_data()["comm_hook"]
    assert "registered its own DDP comm hook" in caplog.text


def test_a_hook_that_cannot_be_registered_is_said_and_training_goes_on(
        installed: list[hooks.ScriptProfiler], world_of_one: None) -> None:
    prof = _install(installed, Overrides(comm_hook="bf16"))  # needs CUDA and NCCL
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    _train(ddp)
    assert prof.on and prof.timer is not None and prof.timer.steps == 3
    assert prof.refused and "ddp.comm_hook=bf16" in prof.refused[0]


def test_host_syncs_are_counted_per_step_through_warnings(installed: list[hooks.ScriptProfiler],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's sync debug mode warns at each synchronizing call; on the CPU the warnings are fed by hand."""
    shown: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: shown.append(str(message)))
    warnings.simplefilter("always", UserWarning)
    prof = _install(installed, None)
    own: dict[str, Any] = {"warnings": warnings}
    exec(compile(f"def sync():\n    warnings.warn({outside.SYNC_WARNING!r}, stacklevel=1)\n", outside._OWN[0],
                 "exec"), own)  # a function whose code is dtrain's clock's
    outside.count_host_syncs(prof, cuda=False)
    prof.counting_syncs = True
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(48, 4), torch.randn(48, 1)), batch_size=4)
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        warnings.warn(outside.SYNC_WARNING, stacklevel=1)  # as loss.item() on CUDA would, every step
        own["sync"]()  # dtrain's own timing reading its CUDA events back: not the script's
        opt.step()
        opt.zero_grad()
        if i == 5:
            break
    warnings.warn("something else", stacklevel=1)
    outside.stop_counting_syncs()
    assert prof.timer is not None and prof.timer.steps == 6
    assert prof.host_syncs == 6  # one per step (the timer starts at the first backward, before the first warning)
    assert shown == ["something else"]  # the counted ones are not shown; others are
