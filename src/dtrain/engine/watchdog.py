"""A worker's side of failure handling: die with the launcher, say where it is, hear stop requests.

* :func:`die_with_launcher`: the kernel kills this worker when the ``dtrain`` process that started it
  dies, by any signal (``prctl(PR_SET_PDEATHSIG)``); torch's agent starts workers in sessions of their
  own, so a kill of the launcher's process group would otherwise miss them.
* :data:`STATUS`: where this rank is (batch, phase, since when). The step loop and the context update it
  with plain attribute writes (no lock, no syscall but a clock read); a background thread
  (:class:`Watchdog`) publishes it twice a second as ``status.rank<r>.json`` in the launcher's status
  folder, so that when a collective times out the launcher can name the rank that stopped and what the
  waiting rank was doing (:mod:`dtrain.launcher.culprit`).
* :data:`STOP`: set when the launcher asks for a clean stop (SIGUSR1, after the launcher itself got
  SIGTERM or SIGINT); the ranks then agree on a batch to stop at (:mod:`dtrain.engine.stopping`).

A SIGTERM sent to the worker itself (Slurm signals every process of a job step) is taken as part of a
clean stop when the launcher's request follows within :data:`CONFIRM_SECONDS`; otherwise it is the
agent tearing the workers down after a failure, and the worker exits at once (exit code 143), even
while its main thread is blocked inside a collective, where no Python signal handler could run.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Set by the launcher in every worker's environment.
LAUNCHER_PID_ENV = "DTRAIN_LAUNCHER_PID"
STATUS_DIR_ENV = "DTRAIN_STATUS_DIR"
STATUS_FILE = "status.rank{rank}.json"
PERIOD_SECONDS = 0.5
CONFIRM_SECONDS = 1.0
_PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """Have the kernel SIGKILL this process when its launcher dies (no-op outside ``dtrain``'s agent).

    The signal fires when the *thread* that forked us exits: the agent runs in the launcher's main thread,
    and a worker forked from dtrain's fork server (whose pid it puts here) dies with the server, which exits
    as soon as the launcher is gone.
    """
    expected = os.environ.get(LAUNCHER_PID_ENV, "")
    if not expected.isdigit() or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(expected):  # the launcher died before the prctl: nobody is left to report to
        os._exit(137)


class RankStatus:
    """Where this rank is. Writers are the main thread; the watchdog thread only reads."""

    __slots__ = ("batch", "first_step_end", "phase", "since")

    def __init__(self) -> None:
        self.batch: int | None = None
        self.phase = "startup"
        self.since = time.time()
        # When this process's first step ended (its next batch began): an elastic world's first step, which its
        # membership record times; the status is published twice a second, long after a short step.
        self.first_step_end: float | None = None

    def enter(self, phase: str, batch: int | None = None) -> None:
        """Mark the start of ``phase`` (at ``batch``: the 0-based index of the batch being trained)."""
        self.phase = phase
        self.since = time.time()
        if batch is not None:
            if self.first_step_end is None and self.batch is not None and batch != self.batch:
                self.first_step_end = self.since
            self.batch = batch

    @contextlib.contextmanager
    def during(self, phase: str) -> Any:
        """``with STATUS.during("checkpoint"):`` then back to the phase it interrupted."""
        before = self.phase
        self.enter(phase)
        try:
            yield
        finally:
            self.enter(before)


class StopRequest:
    """A clean stop the launcher asked for; read by the step loop at its agreement points."""

    __slots__ = ("requested", "term_at")

    def __init__(self) -> None:
        self.requested = False
        self.term_at: float | None = None  # monotonic time of a SIGTERM not yet confirmed by the launcher


STATUS = RankStatus()
STOP = StopRequest()


class Watchdog(threading.Thread):
    """Publishes :data:`STATUS` twice a second and turns signals into :data:`STOP` or an exit."""

    def __init__(self, status_dir: Path | None, rank: int, handle_signals: bool = True,
                 master: tuple[str, int] | None = None) -> None:
        super().__init__(name="dtrain-watchdog", daemon=True)
        self.path = status_dir / STATUS_FILE.format(rank=rank) if status_dir is not None else None
        self.static = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "address": _address(master)}
        self._read_fd: int | None = None
        self._writing = threading.Lock()  # publish_now (main thread) and the beat share the temporary file
        if handle_signals and threading.current_thread() is threading.main_thread():
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            # The C-level handler writes the signal number here at once, even while the main thread is
            # blocked in native code (a collective) and the Python-level handlers below cannot run yet.
            signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                signal.signal(sig, _noted)
            self._read_fd = read_fd
            # A forked child (a DataLoader worker) must neither report its own signals through our pipe
            # nor survive the SIGTERM its parent may send it.
            os.register_at_fork(after_in_child=_reset_in_child)

    def run(self) -> None:
        next_write = 0.0
        while True:
            now = time.monotonic()
            if now >= next_write:
                self.publish()
                next_write = now + PERIOD_SECONDS
            timeout = max(0.0, next_write - now)
            if STOP.term_at is not None:
                timeout = min(timeout, 0.1)
            if self._read_fd is not None:
                ready, _, _ = select.select([self._read_fd], [], [], timeout)
                if ready:
                    self._signals(os.read(self._read_fd, 64))
            else:
                time.sleep(timeout)
            if STOP.term_at is not None and not STOP.requested and time.monotonic() - STOP.term_at > CONFIRM_SECONDS:
                # SIGTERM without the launcher's stop request: the agent stopping the workers after a failure.
                self.publish()
                os._exit(128 + signal.SIGTERM)

    def _signals(self, received: bytes) -> None:
        for signum in received:
            if signum == signal.SIGUSR1:
                STOP.requested = True
            elif signum == signal.SIGTERM and STOP.term_at is None:
                STOP.term_at = time.monotonic()

    def publish(self) -> None:
        """Write this rank's status file (atomically: the launcher may read it at any moment)."""
        if self.path is None:
            return
        record = {**self.static, "batch": STATUS.batch, "phase": STATUS.phase, "since": STATUS.since,
                  "time": time.time(), "gpu": _uses_gpu(), "first_step_end": STATUS.first_step_end}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with self._writing, contextlib.suppress(OSError):
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)


def _uses_gpu() -> bool:
    """Whether this process has started CUDA: then its phase is the host's, and the GPU, which runs behind
    it, may still be inside an earlier collective (a stalled peer shows where the host next waits)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _address(master: tuple[str, int] | None) -> str:
    """The address this process reaches the job's master from (no packet is sent): names a lost node."""
    if master is None or not master[0]:
        return ""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master[0], master[1] or 1))
            return str(probe.getsockname()[0])
    except (OSError, ValueError):
        return ""


def _noted(signum: int, frame: Any) -> None:
    """Python-level handler: the watchdog thread acts on the signal (it got it through the wakeup fd)."""
    del signum, frame


def _reset_in_child() -> None:
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)


_WATCHDOG: Watchdog | None = None


def _start_fresh_in_child() -> None:
    """A forked process (a worker forked from the fork server) starts in its own "startup": else its status
    would say it had been starting up since the server imported this module. And it has no watchdog:
    the parent's thread is not in the child, so a worker starts its own (and a DataLoader worker, forked
    from a rank, does not publish the rank's status)."""
    global _WATCHDOG
    STATUS.__init__()
    _WATCHDOG = None


os.register_at_fork(after_in_child=_start_fresh_in_child)


def start(status_dir: Path | None, rank: int, handle_signals: bool = True,
          master: tuple[str, int] | None = None) -> Watchdog:
    """Start this process's watchdog (once): call early in the worker's main thread. ``master``: the job's
    MASTER_ADDR/PORT, to publish which address this rank reaches it from."""
    global _WATCHDOG
    if _WATCHDOG is None:
        if status_dir is not None:
            status_dir.mkdir(parents=True, exist_ok=True)
        _WATCHDOG = Watchdog(status_dir, rank, handle_signals, master)
        _WATCHDOG.start()
    return _WATCHDOG


def publish_now() -> None:
    """Write the status at once (before a failing worker exits: the phase it failed in)."""
    if _WATCHDOG is not None:
        _WATCHDOG.publish()


def status_dir_from_env() -> Path | None:
    value = os.environ.get(STATUS_DIR_ENV)
    return Path(value) if value else None
