"""Starting workers on PyTorch's own elastic agent (the engine behind ``torchrun``).

dtrain adds only what the agent does not do: a run directory, per-rank logs, and on failure one
readable line naming the failing rank and its root cause instead of the agent's wall of text.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from dtrain.worker import USER_ERROR_FILE


@dataclass(frozen=True)
class LaunchOptions:
    slots: int
    max_restarts: int = 0
    # Where the agent writes non-chief ranks' stdout/stderr; None leaves every rank on the console.
    log_dir: Path | None = None
    debug: bool = False


@dataclass(frozen=True)
class Failure:
    rank: int
    exit_code: int
    message: str
    user_error: bool


def _threads_per_worker(slots: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // slots)


def _quiet_agent(debug: bool) -> None:
    # The agent logs every failure at ERROR with a long banner; dtrain prints the root cause instead.
    level = logging.INFO if debug else logging.CRITICAL
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run"):
        logging.getLogger(name).setLevel(level)


def launch(command: list[str], options: LaunchOptions) -> Failure | None:
    """Run ``command`` (a Python module or script and its args) on ``options.slots`` local workers.

    Returns None on success, else the first (root-cause) failure.
    """
    _quiet_agent(options.debug)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads_per_worker(options.slots)))
    logs_specs = DefaultLogsSpecs()
    if options.log_dir is not None:
        options.log_dir.mkdir(parents=True, exist_ok=True)
        # Rank 0 keeps the terminal (for its progress bar); the others write to files.
        logs_specs = DefaultLogsSpecs(
            log_dir=str(options.log_dir), redirects={r: Std.ALL for r in range(1, options.slots)}
        )
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=options.slots,
        run_id=f"dtrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=options.max_restarts,
        monitor_interval=0.1,
        logs_specs=logs_specs,
    )
    try:
        elastic_launch(config, sys.executable)(*command)
    except ChildFailedError as exc:
        return _root_cause(exc, options.log_dir.parent if options.log_dir is not None else None)
    return None


def _root_cause(exc: ChildFailedError, run_dir: Path | None) -> Failure:
    rank, failure = exc.get_first_failure()
    if run_dir is not None:
        user = _user_error(run_dir)
        if user is not None:
            return user
    message = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)
    if not message or message == "<N/A>":
        message = f"exited with code {failure.exitcode}"
    callstack = ""
    if isinstance(failure.error_file_data, dict):
        info = failure.error_file_data.get("message", {})
        callstack = info.get("extraInfo", {}).get("py_callstack", "") if isinstance(info, dict) else ""
    where = _last_frame(callstack)
    return Failure(rank, failure.exitcode or 1, message + (f" ({where})" if where else ""), user_error=False)


def _user_error(run_dir: Path) -> Failure | None:
    logs = run_dir / "logs"
    found = sorted(logs.glob(USER_ERROR_FILE.format(rank="*")))
    if not found:
        return None
    data = json.loads(found[0].read_text())
    rank = int(found[0].name.split("rank")[1].split(".")[0])
    for path in found:  # every rank usually hits the same bad input; one line is enough
        path.unlink()
    return Failure(rank, int(data.get("exit_code", 2)), data["message"], user_error=True)


def _last_frame(callstack: str) -> str:
    """'File "x.py", line 12, in f' of the innermost frame of a traceback."""
    frames = [ln.strip() for ln in callstack.splitlines() if ln.strip().startswith('File "')]
    return frames[-1].replace('"', "") if frames else ""
