"""One run per run directory: an ``fcntl.flock`` on ``RUN_DIR/.lock``, held by the launcher for the whole run.

The kernel releases a flock when the last descriptor on it closes, so a launcher that dies by any signal
(SIGKILL included) never leaves the directory locked; a stale lock file is harmless. Workers do not hold
it (``subprocess`` closes inherited descriptors; a forked child closes its copy at once), so it is free as
soon as the launcher is gone, and its workers die with it (:func:`dtrain.engine.watchdog.die_with_launcher`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
import weakref
from pathlib import Path
from typing import IO

from dtrain.errors import UserError

LOCK_NAME = ".lock"

# Locks this process holds; a forked child (a worker, a DataLoader's) closes its copies of their files.
_HELD: weakref.WeakSet[RunLock] = weakref.WeakSet()


def _close_in_child() -> None:
    for lock in list(_HELD):
        lock.forget()


os.register_at_fork(after_in_child=_close_in_child)


class RunLock:
    """A held lock on one run directory; :meth:`release` (or process exit) frees it."""

    def __init__(self, run_dir: Path, handle: IO[str]) -> None:
        self.run_dir = run_dir
        self._handle: IO[str] | None = handle

    def forget(self) -> None:
        """Close this process's descriptor without unlocking: the lock stays with its other holders."""
        if self._handle is not None:
            with contextlib.suppress(OSError):
                self._handle.close()  # close(2) drops this copy only; flock(LOCK_UN) would unlock for all
            self._handle = None

    def release(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None


def lock_run_dir(run_dir: Path) -> RunLock:
    """Take the run directory's lock, creating the directory if needed; UserError (exit 2) if another
    live dtrain process holds it."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # "a+": opening must not truncate the holder's pid before we know the lock is ours.
        handle = (run_dir / LOCK_NAME).open("a+")
    except OSError as exc:
        raise UserError(f"cannot write run directory {run_dir}: {exc.strerror or exc}; "
                        "choose a writable place with --run-dir") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UserError(f"run directory {run_dir} is in use by another dtrain run ({holder}); wait for it to "
                        "finish or stop it, or choose another --run-dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    lock = RunLock(run_dir, handle)
    _HELD.add(lock)
    return lock
