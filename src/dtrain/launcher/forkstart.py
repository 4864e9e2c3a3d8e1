"""Starting dtrain's own workers by forking the launcher, which has already imported torch.

A worker started as a new interpreter spends about 4 s of CPU before its first step importing torch and
``torch._dynamo`` (DDP's constructor reaches into it), on every slot and on every elastic restart; on a
busy machine that is most of a short run. A forked worker inherits those imports. torch's elastic agent
starts function entrypoints by fork (``LaunchConfig(start_method="fork")``), so dtrain keeps the agent
and only decides when a fork is safe and makes the child look like a freshly started worker:

* a session of its own (as the agent gives an exec'd worker), so that a stop signals its process group;
* the signal handlers a new interpreter has, not the launcher's supervisor's;
* new standard stream objects on the process's file descriptors, even where the launcher's Python
  streams were replaced (a notebook, a test capturing output): the agent redirects a rank's output by
  descriptor, and a launcher's stream may have been locked by one of its threads at the fork;
* exactly as many torch threads as ``OMP_NUM_THREADS`` says, which the inherited runtime no longer reads.

A fork is not safe, and workers are started as new interpreters as before, when:

* torch is built for CUDA or ROCm: their runtimes do not survive a fork once initialised, and the
  launcher may have touched them (``torch.cuda.is_available()`` already does);
* a worker gets more than one torch thread: GNU OpenMP's thread pool does not survive a fork. Measured
  here: after the parent ran a 2-thread op, a forked child's first 2-thread op hung (1 thread: fine);
* not on Linux, or ``DTRAIN_WORKER_START=exec`` (the escape hatch, should a user's setup disagree).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

START_ENV = "DTRAIN_WORKER_START"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)

# True only while the agent forks our workers: other forks of the process (a DataLoader's) are left alone.
_forking = False


@dataclass(frozen=True)
class WorkerModule:
    """dtrain's own worker: ``python -m <module> <argv>``, whose ``main(argv)`` can also run in a fork."""

    module: str
    argv: tuple[str, ...]

    @property
    def command(self) -> list[str]:
        """The command of an exec'd worker (unbuffered output: its lines reach the log as they happen)."""
        return ["-u", "-m", self.module, *self.argv]


def can_fork(threads: int) -> bool:
    """Whether workers with ``threads`` torch threads each may be forked from this process (see above)."""
    if os.environ.get(START_ENV, "fork") == "exec" or not sys.platform.startswith("linux"):
        return False
    if torch.backends.cuda.is_built() or getattr(torch.version, "hip", None):
        return False
    return threads == 1


def how_to_start(command: list[str] | WorkerModule, threads: int) -> tuple[bool, Any, list[str]]:
    """(fork?, the agent's entrypoint, its arguments) for ``command``: dtrain's own worker forked where
    :func:`can_fork` allows (its imports done here first), else a new interpreter running ``command``."""
    if not isinstance(command, WorkerModule):
        return False, sys.executable, command
    if not can_fork(threads):
        return False, sys.executable, command.command
    preload(command)
    return True, ForkedMain(command), list(command.argv)


def preload_torch() -> None:
    """Import what torch itself would import in each worker: DDP's constructor reaches into
    ``torch._dynamo`` (about 1.5 s per process)."""
    importlib.import_module("torch._dynamo")


def preload(worker: WorkerModule) -> None:
    """Import, once in the launcher, what every worker would import: the forks inherit it."""
    preload_torch()
    importlib.import_module(worker.module)


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Within: forks of this process become workers (:func:`_make_worker_process`)."""
    global _forking
    _forking = True
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns on fork in a threaded process. The launcher's threads (the supervisor,
            # torch's rendezvous keep-alive and store server) hold no lock that the worker takes: it only
            # opens its own connections, and Python resets its own locks (import, logging) in the child.
            warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks",
                                    category=DeprecationWarning)
            yield
    finally:
        _forking = False


def _make_worker_process() -> None:
    """Run in every forked child, before torch's agent wraps the entrypoint."""
    global _forking
    if not _forking:
        return
    _forking = False
    # Everything inherited from the launcher (torch, its modules, a test runner's heap) lives as long as
    # the worker: frozen, the worker's collections skip it (the Python docs' advice for fork without
    # exec). Otherwise the gc.collect() before leaving the process group walks the whole inherited heap in
    # every forked worker (a test runner's, say), copying every page it touches.
    gc.freeze()
    os.setsid()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Before anything that could wait on something inherited: until the worker installs its own stop
    # handlers, the agent's SIGTERM (it stops the survivors of a failed rank) first writes every thread's
    # Python stack to the rank's log (fd 2, where the agent points it), so a child stuck before it started
    # says where. (After the resets above, which would replace it.)
    faulthandler.register(signal.SIGTERM, file=2, all_threads=True, chain=True)
    _fresh_standard_streams()


def _fresh_standard_streams() -> None:
    """New ``sys.stdout``/``sys.stderr`` on descriptors 1 and 2, line-buffered as ``python -u`` would be.

    Not the launcher's stream objects: one of its threads may have been writing to one when it forked, and
    the child inherits that stream's lock held by a thread that does not exist here, so its first flush
    waits forever (the agent flushes both before redirecting them). Measured with a thread writing to a
    stream while the main thread forks 300 children that flush it: 298 hung; with fresh objects: none. (A
    rank of the suite's 4-slot resume test once hung before its first line, its log empty: the likeliest
    such lock.) The inherited objects stay referenced by ``sys.__stdout__``/``sys.__stderr__``: freed, they
    would flush, and take that lock; the worker ends with ``os._exit`` (multiprocessing's fork), which
    never frees them. The launcher's unflushed lines stay the launcher's instead of being written twice.
    """
    for name, fd in (("stdout", 1), ("stderr", 2)):
        inherited = getattr(sys, f"__{name}__")
        if inherited is None:  # a launcher without this stream: nothing to replace
            continue
        # Lives as long as the process; closefd=False: descriptor 1 or 2 is not this object's to close.
        fresh = open(fd, "w", buffering=1, encoding=inherited.encoding,  # noqa: SIM115
                     errors=inherited.errors, closefd=False)
        setattr(sys, name, fresh)


os.register_at_fork(after_in_child=_make_worker_process)


class ForkedMain:
    """The agent's entrypoint for forked workers: ``main(argv)`` of :attr:`worker`'s module."""

    def __init__(self, worker: WorkerModule) -> None:
        self.worker = worker
        # torch's agent names the entrypoint in its logs
        self.__name__ = self.__qualname__ = f"{worker.module}.main"

    def __call__(self, *argv: str) -> None:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        main = importlib.import_module(self.worker.module).main
        try:
            main(list(argv))
        except KeyboardInterrupt:
            # torch's process wrapper would turn it into exit code 0, which the agent awaits a result for.
            raise SystemExit(128 + signal.SIGINT) from None
