"""The launcher's side of stopping: signals to the ``dtrain`` process become a clean stop of its workers.

torch's agent would turn SIGINT/SIGTERM into an exception (a 35-line traceback) and SIGTERM the workers
mid-step. Instead, while the agent runs, :class:`Supervisor` holds those two signals:

* first signal: a clean stop. Each worker gets SIGUSR1 (:data:`dtrain.engine.watchdog.STOP`); the ranks agree on
  a batch, write a checkpoint there and exit 0 (:mod:`dtrain.engine.stopping`). Whatever is still running after
  the grace period (``resources.preemption_grace_seconds``) is killed. Without a clean-stop protocol
  (``dtrain launch``: the user's own script), the workers get SIGTERM and a few seconds.
* second signal: every worker is killed at once.

It also unfreezes the job when a stopped (SIGSTOP) worker would hold it: once any worker of the job is
gone (it failed, say after its collective timed out waiting for the frozen one), a worker in state T can
never answer again; the agent would wait 30 s for it to take its SIGTERM, the supervisor kills it now.

:class:`Stopped` is what the launcher raises afterwards; the command line turns it into one line and
exit code 128 + the signal number (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dtrain.launcher.forkstart import HELPER_MARKS, SERVER_NAME

# Without a clean-stop protocol, how long the workers get to exit after SIGTERM.
SCRIPT_GRACE_SECONDS = 3.0
POLL_SECONDS = 0.2


class Stopped(Exception):
    """The run was stopped by a signal to the launcher (not a failure)."""

    def __init__(self, signum: int, batch: int | None = None, clean: bool = False, left: bool = False,
                 signalled_at: float | None = None, no_workers: bool = False) -> None:
        self.signum = signum
        self.batch = batch
        self.clean = clean  # the ranks stopped together and checkpointed at ``batch``
        self.left = left  # this node left an elastic job; the other nodes may go on without it
        self.no_workers = no_workers  # no worker of this node had started (it was meeting the other nodes)
        self.signalled_at = signalled_at  # time.time() of the signal: a stop record before it is another stop's
        super().__init__(f"stopped by {self.signal_name}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def terminate_as_stop() -> Iterator[None]:
    """Within: SIGTERM raises :class:`Stopped` (the supervisor takes over while workers run)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def children(pid: int | None = None) -> list[int]:
    """The workers of ``pid`` (default: this process), from /proc: its child processes, where the fork
    server it forks workers from (dtrain.launcher.forkstart) stands for the server's children, and without
    the server's resource tracker."""
    found: list[int] = []
    for child in _direct_children(pid or os.getpid()):
        if is_server(child):
            found.extend(_direct_children(child))
        elif HELPER_MARKS[1] not in _cmdline(child):
            found.append(child)
    return found


def _direct_children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            found.extend(int(c) for c in (task / "children").read_text().split())
    return found


def is_server(pid: int) -> bool:
    """Whether ``pid`` is a launcher's fork server, spawned (by its command line) or forked from the launcher
    (by its name: its command line is the launcher's)."""
    try:
        if Path(f"/proc/{pid}/comm").read_text().strip() == SERVER_NAME[:15]:
            return True
    except OSError:
        return False
    return HELPER_MARKS[0] in _cmdline(pid)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (R, S, D, T, Z, ...), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


class Supervisor:
    """``with Supervisor(grace, clean=True) as sup:`` around the agent; ``sup.signum`` tells what stopped it."""

    def __init__(self, grace_seconds: float, clean: bool, status_dir: Path | None = None,
                 on_signal: Callable[[], None] | None = None, shared_world: bool = False,
                 in_world: Callable[[], bool] | None = None) -> None:
        self.grace = grace_seconds if clean else min(grace_seconds, SCRIPT_GRACE_SECONDS)
        self.clean = clean
        # The workers share a world with other nodes' (an elastic job): killing one that is still starting
        # would fail those others' workers too, so it is asked to stop once it is ready, like the rest.
        self.shared_world = shared_world
        # Whether this node met the others for a world (its workers are being forked) rather than waiting to
        # meet them: a signal that finds no worker then waits for them (None: never).
        self.in_world = in_world
        self._awaiting = False  # signalled before this node's workers of a met world were forked
        self._asked: set[int] = set()  # workers told to stop
        self.status_dir = status_dir
        # Called at the first signal, before any worker is told (an elastic node announces that it leaves).
        self.on_signal = on_signal
        self.signalled_at: float | None = None  # time.time() of the first signal
        self._pending: set[int] = set()  # workers still to be told to stop (not ready for SIGUSR1 yet)
        self.signum: int | None = None
        self.deadline: float | None = None
        self._previous: dict[int, Any] = {}
        self._seen: set[int] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dtrain-supervisor", daemon=True)

    def __enter__(self) -> Supervisor:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=2)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    # ------------------------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, frame: Any) -> None:
        del frame
        if self.signum is not None:  # asked again (or the grace period is over): stop now
            self._stop_now()
        self.signum = signum
        self.signalled_at = time.time()
        if self.on_signal is not None:
            with contextlib.suppress(Exception):  # a note for the other nodes must not stop this stop
                self.on_signal()
        self.deadline = time.monotonic() + self.grace
        if not self.clean:  # the agent starts each worker in a session of its own: signal its whole group
            for pid in children():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGTERM)
            return
        self._pending = set(children())
        self._seen |= self._pending
        training = self._statuses()
        starting = any(training.get(pid) is None for pid in self._pending)
        if not self._pending and self._workers_coming():
            # Between meeting the other nodes and forking this node's workers: the others' workers are starting
            # in the same world, so these are asked to stop once ready like the rest (killed, they would fail
            # the others' as a lost node would).
            self._awaiting = True
        elif not self._pending or (starting and not self.shared_world):
            # No worker yet, or one still starting: no step ran since the last checkpoint, so there is
            # nothing to save, and waiting for the start to finish could take longer than the grace period.
            self._stop_now()
        self._tell_ready()

    def _stop_now(self) -> None:
        """Kill every worker and make the agent give up at once (an exception it knows: no restarts)."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        self._pending.clear()
        self._kill_all(signal.SIGKILL)
        assert self.signum is not None
        raise SignalException(f"dtrain stopping on {signal.Signals(self.signum).name}",
                              sigval=signal.Signals(self.signum))

    def _statuses(self) -> dict[int, int | None]:
        """pid -> batch of every worker that published a status (batch None: not training yet)."""
        found: dict[int, int | None] = {}
        for path in self.status_dir.glob("status.rank*.json") if self.status_dir is not None else ():
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                record = json.loads(path.read_text())
                found[int(record["pid"])] = record["batch"]
        return found

    def _ready(self) -> set[int]:
        """Workers whose watchdog runs (it published a status): SIGUSR1 would kill one still starting."""
        return set(self._statuses())

    @property
    def had_workers(self) -> bool:
        """Whether any worker of this launcher was seen running."""
        return bool(self._seen)

    def _workers_coming(self) -> bool:
        return self.shared_world and self.in_world is not None and self.in_world()

    def _await_workers(self) -> None:
        """Signalled before this node's workers were forked: each one forked since is to be told; should the
        agent go back to meet the other nodes instead (no worker of this world will come), stop now."""
        if not self._workers_coming():
            self._awaiting = False
            if self.signum is not None:
                os.kill(os.getpid(), self.signum)  # the main thread's handler stops the agent
            return
        found = set(children())
        self._seen |= found
        self._pending |= found - self._asked

    def _tell_ready(self) -> None:
        if not self._pending:
            return
        ready = self._pending & self._ready()
        for pid in ready:
            _kill(pid, signal.SIGUSR1)
        self._pending -= ready
        self._asked |= ready

    def _kill_all(self, sig: int) -> None:
        for pid in children():
            _kill(pid, sig)

    # ------------------------------------------------------------------------------------- watching
    def _watch(self) -> None:
        while not self._done.wait(POLL_SECONDS):
            if self._awaiting:
                self._await_workers()
            self._tell_ready()
            if self.deadline is not None and time.monotonic() > self.deadline:
                self.deadline = None
                assert self.signum is not None
                os.kill(os.getpid(), self.signum)  # the main thread's handler stops the agent
            self._unfreeze()

    def _unfreeze(self) -> None:
        """Once a worker has exited, a stopped (state T) sibling can never answer: kill it."""
        current = set(children())
        if self._seen - current:
            for pid in current:
                if process_state(pid) == "T":
                    _kill(pid, signal.SIGKILL)
        self._seen |= current
