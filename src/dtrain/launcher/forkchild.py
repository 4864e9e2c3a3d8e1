"""What runs first in a worker forked from dtrain's fork server (:mod:`dtrain.launcher.forkstart`), to make it
look as a freshly started worker; and what the server and its workers both use."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import io
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import weakref
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def set_name(name: str) -> None:
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(name[:15])


def become_worker(launcher_env: dict[str, str], server_env: dict[str, str],
                  launcher_streams: dict[int, Any] | None = None) -> None:
    """Run first in every forked worker: make it look as a freshly started one (see
    :mod:`dtrain.launcher.forkstart`)."""
    _take_environment(launcher_env, server_env)
    _take_streams(launcher_streams or {})
    # What the fork server imported lives as long as the worker: frozen, the worker's collections skip it
    # (the Python docs' advice for fork without exec).
    gc.freeze()
    _keep_inherited_finalizers_from_exit()
    os.setsid()
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Until the worker installs its own stop handlers, the agent's SIGTERM (it stops the survivors of a
    # failed rank) first writes every thread's Python stack to the rank's log (fd 2, where the agent points
    # it), so a child stuck before it started says where.
    faulthandler.register(signal.SIGTERM, file=2, all_threads=True, chain=True)
    set_name(Path(sys.executable).name)  # a worker's name, not its server's, as an exec'd worker's
    _fresh_standard_streams()
    _leave_the_fork_server()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def _take_environment(launcher_env: dict[str, str], server_env: dict[str, str]) -> None:
    """The launcher's environment at the fork, plus what the agent set for this rank: the variables in
    which this process differs from the fork server's start. The watchdog's parent is the fork server: the
    worker dies with it (it exits as soon as the launcher is gone)."""
    from dtrain.engine import watchdog

    for_rank = {k: v for k, v in os.environ.items() if server_env.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(for_rank)
    if watchdog.LAUNCHER_PID_ENV in os.environ:
        os.environ[watchdog.LAUNCHER_PID_ENV] = str(os.getppid())


def _take_streams(launcher_streams: dict[int, Any]) -> None:
    """Standard output and error that the agent did not point at a rank's log: the launcher's at the fork
    (passed with the child, as ``multiprocessing`` passes descriptors), not the fork server's at its start."""
    from dtrain.launcher import forkserver_init

    for fd, passed in launcher_streams.items():
        received = passed.detach()
        if forkserver_init.identity(fd) == forkserver_init.STREAMS.get(fd):
            os.dup2(received, fd)
        os.close(received)


def _leave_the_fork_server() -> None:
    """Close this child's end of the launcher's "alive" pipe, which the fork server gives each child for
    forking from it in turn: held by a worker, it kept the server (and so the worker) alive after the
    launcher was killed. Were the worker to use a fork server, it starts its own."""
    # Python's default start method again, as in a new interpreter: the child of a "forkserver" process
    # inherits that method, which would also start the trial's DataLoader workers through a fork server.
    multiprocessing.set_start_method(None, force=True)
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = server._forkserver_address = server._forkserver_pid = None


def _fresh_standard_streams() -> None:
    """New ``sys.stdout``/``sys.stderr`` on descriptors 1 and 2, unbuffered as ``python -u`` makes them (every
    write goes through, a partial line too): the fork server's own are block-buffered where its output is not
    a terminal, so a rank's lines would reach its log (where the agent points descriptors 1 and 2) late, or
    not at all if it is killed."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        inherited = getattr(sys, f"__{name}__")
        if inherited is None:  # a process without this stream: nothing to replace
            continue
        # Lives as long as the process; closefd=False: descriptor 1 or 2 is not this object's to close.
        raw = io.FileIO(fd, "w", closefd=False)
        fresh = io.TextIOWrapper(raw, encoding=inherited.encoding, errors=inherited.errors,  # type: ignore[arg-type]
                                 write_through=True)
        setattr(sys, name, fresh)


def _keep_inherited_finalizers_from_exit() -> None:
    """The exit-time finalizers of what the fork server imported do not run at this worker's exit: they are
    torch's operator libraries (``torch.library``), each undoing its dispatcher registrations, work of no use
    to a process about to end, which a forked child of ``multiprocessing`` skips too (it leaves by
    ``os._exit``) and which was a visible part of a short run's CPU here. The worker's own finalizers (a
    script's temporary folder) still run at its exit."""
    registry = getattr(weakref.finalize, "_registry", None)  # CPython's: every live finalizer
    for finalizer in list(registry or ()):
        finalizer.atexit = False
