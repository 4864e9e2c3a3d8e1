"""CUDA hidden from every test not marked ``gpu``, for the whole pytest process and what it starts.

On a GPU machine ``dtrain.init()`` and ``backend: auto`` pick NCCL and CUDA, and tests written for CPU slots
that feed CPU tensors fail. Hiding CUDA per test is too late: module- and session-scoped fixtures (a
checkpoint written once per module, a reference run per session) run before any function-scoped fixture.
So :func:`hide` runs from ``pytest_configure``, before collection and before any fixture: it records what
the machine really has (for the ``gpu`` tests, which :func:`reveal` lets see it again), then hides it in
this process (``torch.cuda.is_available``/``device_count``) and in every process started from it
(``CUDA_VISIBLE_DEVICES=""``: workers, forked ranks, pytest-xdist's own workers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

# The machine's own CUDA_VISIBLE_DEVICES, kept for pytest-xdist's workers: they inherit the hidden value.
SAVED_ENV = "DTRAIN_TESTS_CUDA_VISIBLE_DEVICES"
_UNSET = "(unset)"


@dataclass(frozen=True)
class RealCuda:
    """What the machine has, asked before anything was hidden."""

    available: bool
    device_count: int
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES as the machine set it (None: not set)


REAL = RealCuda(False, 0, None)  # replaced by hide()
_originals: dict[str, Any] = {}


def _set_visible(value: str | None) -> None:
    if value is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = value


def hide(in_process: bool = True) -> RealCuda:
    """Record the machine's CUDA, then hide it from this process and its children (idempotent). Not
    ``in_process``: from the children only (pytest-xdist's controller, which runs no test and so need not
    import torch)."""
    global REAL
    if _originals:
        return REAL
    saved = os.environ.get(SAVED_ENV)
    machine = os.environ.get("CUDA_VISIBLE_DEVICES") if saved is None else (None if saved == _UNSET else saved)
    os.environ[SAVED_ENV] = _UNSET if machine is None else machine
    if not in_process:
        _set_visible("")
        return REAL
    import torch

    _set_visible(machine)  # the real question, asked with the machine's own setting
    available = bool(torch.cuda.is_available())
    REAL = RealCuda(available, int(torch.cuda.device_count()) if available else 0, machine)
    _set_visible("")
    _originals.update(is_available=torch.cuda.is_available, device_count=torch.cuda.device_count)
    torch.cuda.is_available = _no_cuda  # type: ignore[assignment]
    torch.cuda.device_count = _no_devices  # type: ignore[assignment]
    return REAL


def _no_cuda() -> bool:
    return False


def _no_devices() -> int:
    return 0


def reveal(monkeypatch: Any) -> None:
    """For one ``gpu`` test: the machine's CUDA again, in this process and for what the test starts."""
    import torch

    if not _originals:
        return
    for name, function in _originals.items():
        monkeypatch.setattr(torch.cuda, name, function)
    if REAL.visible_devices is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", REAL.visible_devices)
