"""The machine's slots, and trial processes started on them and stopped with everything they started.

A trial segment is ``python -m dtrain.cli run ...`` in a session of its own: Ctrl-C on the search reaches
only the search, which then stops its trials itself (the elastic agent in each one takes its workers
down on SIGTERM; whatever survives the grace period is killed).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1


def machine_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


class SlotPool:
    """``total`` slots: CPU slots own a share of the cores, GPU slots one device each."""

    def __init__(self, total: int, per_trial: int, gpus: bool) -> None:
        self.total, self.per_trial, self.gpus = total, per_trial, gpus
        self.free = list(range(total))
        self.cores = machine_cores()
        # GPU slot i is the i-th device this search may use: inside an allocation (Slurm, a container) that
        # is the i-th of the CUDA_VISIBLE_DEVICES it inherited, not physical device i.
        inherited = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        self.devices = inherited if len(inherited) >= total else [str(i) for i in range(total)]

    def take(self) -> tuple[int, ...] | None:
        if len(self.free) < self.per_trial:
            return None
        taken, self.free = tuple(self.free[:self.per_trial]), self.free[self.per_trial:]
        return taken

    def give(self, slots: Sequence[int]) -> None:
        self.free = sorted({*self.free, *slots})

    def cores_of(self, slots: Sequence[int]) -> list[int]:
        """Slot i owns cores [i*n/total, (i+1)*n/total): concurrent trials never share a core when the
        machine has one per slot at least (more slots than cores: they share, round-robin)."""
        n = len(self.cores)
        if n < self.total:
            return sorted({self.cores[i % n] for i in slots})
        return [c for i in slots for c in self.cores[i * n // self.total:(i + 1) * n // self.total]]

    def env(self, slots: Sequence[int]) -> dict[str, str]:
        """Environment for a trial on ``slots``: its devices, and threads that fit its cores (dtrain's workers
        also size their thread pools from the CPU affinity set by :func:`spawn`)."""
        env = {"OMP_NUM_THREADS": str(max(1, len(self.cores_of(slots)) // len(slots)))}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices[s] for s in slots)
        return env


def _child_setup(cores: list[int]) -> None:
    """Runs in the child before exec: pin to the trial's cores; die with the search (SIGTERM, on which the
    agent stops its workers) should the search itself be killed."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(command: list[str], env: dict[str, str], cores: list[int], log_path: Path) -> subprocess.Popen:
    """Start ``command`` in its own session, output appended to ``log_path``."""
    with log_path.open("ab") as log:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
                                # preexec_fn is safe here: the search runs no other threads.
                                preexec_fn=lambda: _child_setup(cores))


def _start_time(pid: int) -> str | None:
    try:  # field 22 of /proc/PID/stat, after the parenthesised command name
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below ``pid``; the start time tells a reused pid apart later."""
    found: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            found.extend((c, t) for c in children if (t := _start_time(c)) is not None)
            todo.extend(children)
    return found


def _signal(pid: int, sig: int, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        (os.killpg if group else os.kill)(pid, sig)


def stop(procs: Sequence[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM each process (its agent stops its workers), then SIGKILL whatever is left after ``grace``."""
    trees = {p.pid: _descendants(p.pid) for p in procs}
    for p in procs:
        _signal(p.pid, signal.SIGTERM, group=True)
    deadline = time.monotonic() + grace
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        _signal(p.pid, signal.SIGKILL, group=True)
        for child, started in trees[p.pid]:  # workers live in sessions of their own, out of the group's reach
            if _start_time(child) == started:
                _signal(child, signal.SIGKILL)
        p.wait()


def error_line(log_path: Path) -> str | None:
    """The last ``dtrain: error: ...`` line of a segment's output (its one-line reason), if any."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("dtrain: error: "):
            return line.removeprefix("dtrain: error: ")
    return None
