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

from dtrain.worker import ERROR_FILE


@dataclass(frozen=True)
class LaunchOptions:
    slots: int
    max_restarts: int = 0
    # A dtrain run directory: non-chief ranks' output goes to logs/agent/ there, and each rank's error
    # report to logs/. None (``dtrain launch``) leaves every rank on the console.
    run_dir: Path | None = None
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
    if options.run_dir is not None:
        log_dir = options.run_dir / "logs" / "agent"
        log_dir.mkdir(parents=True, exist_ok=True)
        # Rank 0 keeps the terminal (for its progress bar); the others write to files.
        logs_specs = DefaultLogsSpecs(
            log_dir=str(log_dir), redirects={r: Std.ALL for r in range(1, options.slots)}
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
        return _root_cause(exc, options.run_dir)
    return None


# Errors a rank gets because *another* rank died: never the root cause when a better candidate exists.
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing",
              "connectFullMesh")
_AGENT_KILL = {-15, 143}  # SIGTERM: the agent stopping the survivors


def _root_cause(exc: ChildFailedError, run_dir: Path | None) -> Failure:
    """The failure to show: bad input first, then the earliest genuine error, then a rank that died
    without a word (killed, os._exit), and only then the peers' "connection closed" echoes."""
    reports = _error_reports(run_dir)
    user = [r for r in reports if r["user_error"]]
    if user:
        return _from_report(min(user, key=lambda r: r["time"]))
    primary = [r for r in reports if not any(p in r["message"] for p in _SECONDARY)]
    if primary:
        return _from_report(min(primary, key=lambda r: r["time"]))
    reported = {r["rank"] for r in reports}
    for rank, failure in sorted(exc.failures.items()):
        if rank not in reported and failure.exitcode not in _AGENT_KILL:
            how = (f"killed by signal {failure.signal_name()}" if failure.exitcode < 0
                   else f"exited with code {failure.exitcode} without raising an exception")
            return Failure(rank, 1, how, user_error=False)
    if reports:
        return _from_report(min(reports, key=lambda r: r["time"]))
    rank, failure = exc.get_first_failure()
    return Failure(rank, 1, f"exited with code {failure.exitcode}", user_error=False)


def _error_reports(run_dir: Path | None) -> list[dict]:
    if run_dir is None:
        return []
    reports = []
    for path in (run_dir / "logs").glob(ERROR_FILE.format(rank="*")):
        try:
            reports.append(json.loads(path.read_text()))
        except ValueError:
            continue
        path.unlink()  # consumed: a later attempt or resume starts clean
    return reports


def _from_report(report: dict) -> Failure:
    message = report["message"] + (f" (at {report['where']})" if report.get("where") else "")
    return Failure(int(report["rank"]), int(report["exit_code"]), message, user_error=bool(report["user_error"]))
