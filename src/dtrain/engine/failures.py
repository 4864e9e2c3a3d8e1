"""How a failing rank's cause reaches the launcher: the error-file protocol (format and the worker's side).

A worker that fails writes ``logs/error.rank<r>.json`` (:func:`write_report`); the launcher reads every
report (:func:`read_reports`) and names the root cause in one line
(:func:`dtrain.launcher.culprit.root_cause`). torch's own
``@record`` keeps only a one-second timestamp, too coarse to tell the rank that failed first from the peers
that failed because of it; these reports keep a precise time and the innermost frame.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ERROR_FILE = "error.rank{rank}.json"
# Errors a rank gets because *another* rank died: never the root cause when a better candidate exists.
SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing",
             "connectFullMesh")
# How long a rank that only saw a peer's connection close waits before exiting. torch's agent reports one
# failed worker per poll (every 0.1 s) when workers are forked: the peer that died first (os._exit, the
# OOM killer: no report of its own) must be the one it sees, not this echo of it.
ECHO_EXIT_DELAY_SECONDS = 0.5


@dataclass(frozen=True)
class Failure:
    """The one failure the launcher shows."""

    rank: int
    exit_code: int
    message: str
    user_error: bool
    # The message is a whole sentence about the job (it names the ranks itself), not one rank's error.
    standalone: bool = False
    # Not an error: the job stopped cleanly at a checkpoint (an elastic job left with too few nodes).
    clean_stop: bool = False

    def headline(self) -> str:
        return self.message if self.standalone else f"worker rank {self.rank} failed: {self.message}"


@dataclass(frozen=True)
class ErrorReport:
    """One rank's failure, as written to its error file."""

    rank: int
    message: str
    where: str
    time: float
    user_error: bool
    exit_code: int
    # The rank the failure is about when it is not the reporting one (all ranks stop on a non-finite loss
    # that appeared on one of them).
    blame: int | None = None

    def failure(self) -> Failure:
        message = self.message + (f" (at {self.where})" if self.where else "")
        return Failure(self.rank if self.blame is None else self.blame, self.exit_code, message, self.user_error)

    @property
    def secondary(self) -> bool:
        return is_secondary(self.message)


def is_secondary(message: str) -> bool:
    """Whether an error only echoes a peer's failure (its connection closed)."""
    return any(p in message for p in SECONDARY)


def write_report(folder: Path, rank: int, exc: BaseException, user_error: bool, exit_code: int,
                 where: str | None = None, blame: int | None = None) -> None:
    """Worker side: leave this rank's failure for the launcher in ``folder`` (a run's logs/); ``where``
    defaults to the innermost frame."""
    if where is None:
        frames = traceback.extract_tb(exc.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames and not user_error else ""
    report = ErrorReport(rank=rank, message=str(exc) if user_error else f"{type(exc).__name__}: {exc}", where=where,
                         time=time.time(), user_error=user_error, exit_code=exit_code, blame=blame)
    (folder / ERROR_FILE.format(rank=rank)).write_text(json.dumps(asdict(report)))


def read_reports(folder: Path | None, own_ranks: set[int] | None = None) -> list[ErrorReport]:
    """Launcher side: every rank's report in ``folder``; this node's own (``own_ranks``; None = all) are
    consumed, so a later attempt or resume starts clean. On shared storage, other nodes' reports are left
    for their own launchers to read."""
    if folder is None:
        return []
    reports = []
    for path in folder.glob(ERROR_FILE.format(rank="*")):
        try:
            report = ErrorReport(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        reports.append(report)
        if own_ranks is None or report.rank in own_ranks:
            path.unlink(missing_ok=True)
    return reports
