"""Naming the rank that stopped a job, from the statuses every rank publishes (:mod:`dtrain.engine.watchdog`).

When a rank hangs or freezes, its peers only learn it by timing out in a collective, and Gloo's error
("Timed out waiting 20000ms for recv") names the rank that *waited*. This module turns the waiting
ranks' timeout reports and every rank's last status into one line that names the silent rank, its host
and pid, what it was doing and since when, and what the waiting rank was doing::

    rank 1 on host vm (pid 812) stopped in train_batch at batch 20, 21 s ago (alive, but not answering);
    rank 0 waited in backward (gradient all-reduce) at batch 20 and timed out after 20 s

A rank's status carries two times: ``since`` (when it entered its phase) and ``time`` (the last
heartbeat). A hung rank (sleeping, deadlocked in its own code) keeps beating; a frozen one (SIGSTOP, a
debugger, a swapping machine) does not.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.engine.failures import ErrorReport, Failure
from dtrain.engine.watchdog import STATUS_FILE

# A heartbeat older than this (the watchdog beats twice a second) means the process is not running at all.
_AGENT_KILL = {-15, 143}  # SIGTERM: the agent stopping the survivors
STALE_SECONDS = 3.0
# A collective or store that timed out (Gloo, NCCL's watchdog, the c10d store), not any error that says
# "timeout": a native source location ("unbound_buffer.cc:78") or the libraries' own phrasing.
_TIMEOUT = re.compile(r"timed out waiting|collective operation timeout|socket timeout|wait timeout", re.IGNORECASE)
_NATIVE_TIMEOUT = re.compile(r"\.(cc|cpp|hpp|h):\d+.*(timed out|timeout)", re.IGNORECASE | re.DOTALL)
_MS = re.compile(r"(\d+)\s*ms")
# Phases (named by the trainer and the context) in which a rank waits for all the others.
COLLECTIVE_PHASES = frozenset({"backward (gradient all-reduce)", "gradient exchange", "weight sync",
                               "metric all-reduce", "stop vote", "checkpoint", "end-of-run gather"})


@dataclass(frozen=True)
class Status:
    """One rank's last published status."""

    rank: int
    host: str
    pid: int
    batch: int | None
    phase: str
    since: float
    time: float
    address: str = ""
    gpu: bool = False  # CUDA: the phase is where the host is; the GPU runs behind it
    first_step_end: float | None = None  # when the process's first step ended (None: not yet, or not said)

    @property
    def communicating(self) -> bool:
        """In a phase that waits for the other ranks (a collective)."""
        return self.phase in COLLECTIVE_PHASES

    def where(self) -> str:
        place = f"{self.phase}" + (f" at batch {self.batch}" if self.batch is not None else "")
        if self.gpu:
            place += " (as the host saw it: its GPU may still have been in an earlier collective)"
        return place

    @property
    def place(self) -> str:
        """Host name, and the address when it is not loopback (hosts may share a name: containers)."""
        remote = self.address and not self.address.startswith("127.")  # one machine: the host name says it all
        return f"{self.host} ({self.address})" if remote else self.host

    def who(self) -> str:
        return f"rank {self.rank} on host {self.place} (pid {self.pid})"


def read_statuses(folder: Path | None) -> dict[int, Status]:
    """Every rank's status file in ``folder`` (a run's logs/)."""
    found: dict[int, Status] = {}
    if folder is None:
        return found
    for path in folder.glob(STATUS_FILE.format(rank="*")):
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
            status = Status(int(raw["rank"]), str(raw["host"]), int(raw["pid"]),
                            None if raw["batch"] is None else int(raw["batch"]), str(raw["phase"]),
                            float(raw["since"]), float(raw["time"]), str(raw.get("address", "")),
                            bool(raw.get("gpu", False)),
                            None if raw.get("first_step_end") is None else float(raw["first_step_end"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found[status.rank] = status
    return found


def is_timeout(message: str) -> bool:
    """Whether a rank's error is a collective (or store) that gave up waiting for its peers."""
    return bool(_TIMEOUT.search(message) or _NATIVE_TIMEOUT.search(message))


def _timeout_seconds(message: str) -> str:
    match = _MS.search(message)
    return f" after {int(match.group(1)) / 1000:g} s" if match else ""


def explain_timeout(waiter: int, message: str, at: float, timed_out: set[int],
                    statuses: dict[int, Status], world_size: int | None = None) -> tuple[int, str]:
    """(the rank to blame, one line) for a collective that timed out on ``waiter`` at time ``at``.

    ``timed_out``: every rank that reported a timeout (they all waited for someone). ``world_size``, where
    the caller knows every rank: a rank that never published a status is named.
    """
    mine = statuses.get(waiter)
    waited = (f"rank {waiter} waited in {mine.where()}" if mine is not None else f"rank {waiter} waited") + \
        f" and timed out{_timeout_seconds(message)} (resources.collective_timeout_seconds)"
    others = [s for r, s in statuses.items() if r not in timed_out]
    if not others:
        hosts = sorted({s.place for s in statuses.values()})
        if len(hosts) > 1:
            return waiter, (f"ranks on hosts {', '.join(hosts)} all timed out waiting for each other: the network "
                            f"between these hosts is down or blocked (a cut link, a firewall); {waited}")
        silent = [r for r in range(world_size or 0) if r not in statuses]
        if silent:
            return silent[0], (f"rank {silent[0]} never started: it published no status, so it was stuck or dead "
                               f"before its first step (if stuck, its log ends with its stack); {waited}")
        return waiter, f"{waited}; no other rank published where it was (it may have died before starting)"
    frozen = [s for s in others if at - s.time > STALE_SECONDS]
    # A frozen rank first (it cannot answer at all), else the one that has been in its phase longest.
    culprit = min(frozen or others, key=lambda s: s.time if frozen else s.since)
    ago = max(0.0, at - culprit.since)
    if frozen:
        state = (f"stopped answering in {culprit.where()}, {ago:.0f} s ago (no heartbeat for "
                 f"{at - culprit.time:.0f} s: frozen by SIGSTOP or a debugger, or its host is down or unreachable)")
    elif culprit.communicating and mine is not None and mine.communicating and culprit.place != mine.place:
        # Both alive, both inside a collective, on different hosts: they wait for each other.
        return culprit.rank, (f"{culprit.who()} was waiting too, in {culprit.where()}, for {ago:.0f} s: the ranks "
                              f"lost each other, so the network between host {mine.place} and host {culprit.place} is "
                              f"down or blocked (a cut link, a firewall); {waited}")
    else:
        state = f"stopped in {culprit.where()}, {ago:.0f} s ago (alive, but not answering)"
    return culprit.rank, f"{culprit.who()} {state}; {waited}"


def describe_death(rank: int, how: str, statuses: dict[int, Status]) -> str:
    """``killed by signal SIGKILL`` plus where that rank was."""
    status = statuses.get(rank)
    if status is None:
        return how
    return f"{how} (host {status.host}, pid {status.pid}, in {status.where()})"


def root_cause(failures: dict[int, Any], reports: list[ErrorReport],
               statuses: dict[int, Status] | None = None, world_size: int | None = None) -> Failure | None:
    """The failure to show, from the agent's per-rank ``failures`` (exit codes), the reports and the ranks'
    last ``statuses``: bad input first, then the earliest genuine error, then a collective that timed out
    (blaming the rank it waited for, :func:`explain_timeout`), then a rank that died without a word
    (killed, os._exit), and only then the peers' "connection closed" echoes. None: nothing to go on.
    ``world_size``: every rank is this launcher's (one node), so one that never started can be named."""
    statuses = statuses or {}
    user = [r for r in reports if r.user_error]
    if user:
        return min(user, key=lambda r: r.time).failure()
    timeouts = [r for r in reports if not r.secondary and is_timeout(r.message)]
    primary = [r for r in reports if not r.secondary and r not in timeouts]
    if primary:
        return min(primary, key=lambda r: r.time).failure()
    if timeouts:
        first = min(timeouts, key=lambda r: r.time)
        rank, line = explain_timeout(first.rank, first.message, first.time, {r.rank for r in timeouts}, statuses,
                                     world_size)
        return Failure(rank, 1, line, user_error=False, standalone=True)
    reported = {r.rank for r in reports}
    for rank, failure in sorted(failures.items()):
        if rank not in reported and failure.exitcode not in _AGENT_KILL:
            how = (f"killed by signal {failure.signal_name()}" if failure.exitcode < 0
                   else f"exited with code {failure.exitcode} without raising an exception")
            # Its own exit code (a script's sys.exit(2)), for the launcher to pass through.
            code = failure.exitcode if failure.exitcode > 0 else 1
            return Failure(rank, code, describe_death(rank, how, statuses), user_error=False)
    if reports:
        return min(reports, key=lambda r: r.time).failure()
    return None
