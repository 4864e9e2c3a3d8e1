"""Changes made to a script from outside, as the hooks apply them, and what the hooks read off the stack.

For :mod:`dtrain.profiling.script.hooks`: a function's arguments with :class:`~dtrain.profiling.script.overrides.
Overrides` applied (DDP's, the DataLoader's), a comm hook by name, the script's own line that built something
(:func:`script_site`), and the count of synchronizing CUDA calls (torch's sync debug mode warns at each; a
warnings hook counts them and shows none).
"""

from __future__ import annotations

import inspect
import os
import sys
import sysconfig
import warnings
from typing import Any, Protocol

import torch

from dtrain.profiling.script.overrides import Overrides


class SyncSeer(Protocol):
    """What counts the synchronizing calls (the hooks' profiler)."""

    def saw_sync(self) -> None: ...


# What torch's sync debug mode warns with (c10's warn_or_error_on_sync).
SYNC_WARNING = "called a synchronizing CUDA operation"
# Files that are not the script's: torch, dtrain and installed packages (Lightning, Accelerate).
_NOT_SCRIPT = tuple({os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                     sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})


def script_site(depth: int = 2) -> str:
    """The innermost caller outside torch, dtrain and installed packages, as ``file:line`` (``?``: none); called
    once per construction site, never per step."""
    frame = sys._getframe(depth)
    for _ in range(64):
        if frame is None:
            break
        name = frame.f_code.co_filename
        if not name.startswith(_NOT_SCRIPT) and not name.startswith("<"):
                return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def comm_hook(name: str) -> tuple[Any, Any]:
    """(state, hook) of a comm hook by name: torch's own fp16/bf16 compression, or PowerSGD (rank 1, compressing
    from its second iteration: a short --verify run must reach it)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook


# The one counting, and warnings' own showwarning while it counts.
_SEER: list[SyncSeer] = []
_SHOW: list[Any] = []


# dtrain's own timing synchronizes once per window of steps (CUDA events read back): not the script's.
_OWN = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "profiling", name)
             for name in ("clock.py", "timer.py", "comm.py"))


def _dtrains_own(depth: int = 12) -> bool:
    """Whether the synchronizing call came from dtrain's own timing (a few frames up: torch's wrapper, then it)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_filename in _OWN:
            return True
        frame = frame.f_back
    return False


def _show_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    if SYNC_WARNING in str(message):
        if _SEER and not _dtrains_own():
            _SEER[0].saw_sync()
        return
    _SHOW[0](message, category, filename, lineno, file, line)


def count_host_syncs(seer: SyncSeer, cuda: bool) -> None:
    """Count the synchronizing CUDA calls (torch's sync debug mode warns at each; every such warning is counted
    by ``seer``, none shown). ``cuda``: turn the mode on (a test feeds the warnings itself)."""
    _SEER[:] = [seer]
    if not _SHOW:
        _SHOW.append(warnings.showwarning)
        # Every time, not once per place: the default filter shows a warning once per line.
        warnings.filterwarnings("always", message=SYNC_WARNING)
        warnings.showwarning = _show_warning
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")


def with_overrides(init: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                   changes: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` of ``init`` (its ``self`` left out) with ``changes`` made, by name."""
    bound = inspect.signature(init).bind(None, *args, **kwargs)
    bound.arguments.update(changes)
    return tuple(bound.args[1:]), dict(bound.kwargs)


def ddp_changes(over: Overrides) -> dict[str, Any]:
    """DDP's arguments the overrides set."""
    found = {"bucket_cap_mb": over.bucket_cap_mb, "static_graph": over.static_graph,
             "find_unused_parameters": over.find_unused_parameters}
    return {k: v for k, v in found.items() if v is not None}


def loader_changes(init: Any, over: Overrides, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The DataLoader's arguments the overrides change, kept consistent: no prefetch factor and no persistent
    workers without workers (DataLoader refuses both)."""
    found = {k: v for k, v in (("num_workers", over.num_workers), ("pin_memory", over.pin_memory),
                                ("persistent_workers", over.persistent_workers)) if v is not None}
    if not found:
        return found
    bound = inspect.signature(init).bind(None, *args, **kwargs)
    workers = found.get("num_workers", bound.arguments.get("num_workers", 0))
    if not workers:
        found["prefetch_factor"] = None
        found["persistent_workers"] = False
    return found


def stop_counting_syncs() -> None:
    """Sync debug mode off and the warnings as they were (their filter entry stays: it only repeats one
    message that nothing raises any more)."""
    _SEER.clear()
    if not _SHOW:
        return
    warnings.showwarning = _SHOW.pop()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_sync_debug_mode(0)


