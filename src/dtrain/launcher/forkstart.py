"""Starting dtrain's own workers, and scripts' under ``dtrain launch``, from a fork server that has already
imported torch.

A worker started as a new interpreter spends about 4 s of CPU before its first step importing torch and
``torch._dynamo`` (DDP's constructor reaches into it), on every slot and on every elastic restart; on a
busy machine that is most of a short run. A forked worker inherits those imports.

The workers are forked from Python's fork server (``multiprocessing``'s ``forkserver``, which torch's elastic
agent offers as a start method), not from the launcher. The launcher has threads: the agent's rendezvous
store serves the workers from one of them, and it looks up the name of every peer that connects
(``getnameinfo``). A process forked while that thread held the C library's resolver lock inherits it held,
and waits forever on its own first lookup, before its first line: seen in the suite as a 4-slot run whose
last rank never started. The fork server is a process of its own, with one thread, that never opens a
connection, so nothing it forks can inherit a held lock (nor a thread pool: it imports with one thread per
library). It holds torch, ``torch._dynamo`` and the worker's imports (:data:`SERVER_PRELOAD`), imported once,
and lives as long as the launcher: every later run and every elastic restart of this process forks from it.
``dtrain run`` makes it first thing (:func:`start_early`): it imports torch, and while it still has one thread,
forks the server from itself, which then imports the rest while the launcher goes on. A new interpreter as the
server would import torch a second time (about 2.5 s of CPU per launcher); it is still the server where the
launcher has other threads (an in-process run: the API, ``--verify``) or where Python's fork server differs from
the one this module was written for.

A user's script under ``dtrain launch`` (and ``--verify``) is forked the same way (:func:`script_worker`): an
exec'd one imports torch before the script's first line anyway (:mod:`dtrain.engine.script_main` hooks in
first), so the fork spares each slot those imports and changes nothing the script sees, but one thing:
``torch._dynamo`` is imported already, so its ``TORCHDYNAMO_*`` variables are the launcher's, not what the script
might set in ``os.environ`` before its first ``torch.compile``.

dtrain makes each forked child look like a freshly started worker (:class:`ForkedMain`):

* the launcher's current environment, not the one the fork server was started with, plus what the agent
  sets for each rank;
* a session of its own (as the agent gives an exec'd worker), so that a stop signals its process group;
* the signal handlers a new interpreter has;
* exactly as many torch threads as ``OMP_NUM_THREADS`` says, which the inherited runtime no longer reads
  (any number: the fork server never runs an operation, so no OpenMP pool is inherited, which GNU OpenMP's
  would not survive);
* Python's default start method, not the fork server's (a trial's DataLoader workers fork from it), and
  no hold on the fork server's "alive" pipe, which would keep the server up after the launcher died;
* the launcher's ``__main__`` is not imported again in the worker (an exec'd ``python -m`` worker does not
  run it either): a script without a ``__main__`` guard would otherwise start training inside each worker;
* standard streams as ``python -u`` opens them, and for a script the module search path of ``python -m``;
* its exit handlers (``atexit``) run when its main ends, as at a new interpreter's exit, but not the
  exit-time finalizers of what the server imported (:mod:`dtrain.launcher.forkchild` says why).

Workers are started as new interpreters instead when:

* torch is built for CUDA or ROCm: kept on the tested path (a CUDA runtime must not be initialised before
  a fork, which the fork server never does, but no GPU run has checked it yet);
* a script on a slot with more than one thread: numpy's BLAS pool, sized at import, would keep the server's
  one thread;
* not on Linux, or ``DTRAIN_WORKER_START=exec`` (the escape hatch, should a user's setup disagree).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import gc
import importlib
import importlib.metadata
import inspect
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.reduction
import multiprocessing.spawn
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import UserError
from dtrain.launchenv import read_cluster_env
from dtrain.launcher.forkchild import STOP_SIGNALS, become_worker, set_name

START_ENV = "DTRAIN_WORKER_START"
DTRAIN_WORKER = "dtrain.engine.worker"  # the module of dtrain's own worker
SCRIPT_WORKER = "dtrain.engine.script_main"  # what runs a user's script on each slot (dtrain launch, --verify)
PROFILE_ENV = "DTRAIN_PROFILE"  # dtrain.engine.scriptprof.ENV, read here without importing torch
# Part of the fork server's command line (and of its resource tracker's): how the launcher tells these
# helpers from its workers among its child processes.
HELPER_MARKS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")

# What the fork server imports before the worker's module, for every worker it forks: torch, what DDP's
# constructor reaches into, and what a run's chief writes its TensorBoard event file with (imports which a
# process running run after run, as the API and --verify do, would otherwise pay in each run).
SERVER_PRELOAD = ("dtrain.launcher.forkserver_init", "torch", "torch._dynamo", "tensorboard.compat.proto.event_pb2",
                  "tensorboard.compat.proto.summary_pb2", "tensorboard.summary.writer.record_writer")

# The environment the fork server was started with (in the launcher): a child's variables that differ
# from it are the ones the agent set for its rank.
_server_env: dict[str, str] | None = None


@dataclass(frozen=True)
class WorkerModule:
    """dtrain's own worker: ``python -m <module> <argv>``, whose ``main(argv)`` can also run in a fork."""

    module: str
    argv: tuple[str, ...]
    # The module search path of ``python -m <module>`` started here (a user's script imports from it); None:
    # the launcher's, which dtrain's own worker needs nothing beyond.
    path: tuple[str, ...] | None = None

    @property
    def command(self) -> list[str]:
        """The command of an exec'd worker (unbuffered output: its lines reach the log as they happen)."""
        return ["-u", "-m", self.module, *self.argv]


def script_worker(argv: list[str]) -> WorkerModule:
    """A user's script on a slot, through :data:`SCRIPT_WORKER`. Forked, it gets what an exec'd one has before
    the script's first line: torch imported (:mod:`dtrain.engine.script_main` imports it to hook in), the
    environment, ``sys.argv``, the working directory and the module search path of a new interpreter."""
    return WorkerModule(SCRIPT_WORKER, tuple(argv), path=_new_interpreter_path())


def _new_interpreter_path() -> tuple[str, ...]:
    """``sys.path`` of ``python -m`` started now, with this environment (``PYTHONPATH``, the site's ``.pth``
    files): asked of a new interpreter, which imports nothing (a few milliseconds), since a launcher's own path
    begins with whatever started it (the ``dtrain`` command's folder, a test runner's folders)."""
    env = {k: v for k, v in os.environ.items() if k != PROFILE_ENV}  # no profiling hook in the probe
    found = subprocess.run([sys.executable, "-c", "import sys; print(repr(sys.path[1:]))"], env=env,
                           capture_output=True, text=True, check=True)
    return (os.getcwd(), *ast.literal_eval(found.stdout))


def can_fork() -> bool:
    """Whether dtrain's workers may be forked from the fork server (see above)."""
    if not _fork_allowed_here():
        return False
    import torch  # here, not at the top: the light supervisor imports this module's HELPER_MARKS

    return not (torch.backends.cuda.is_built() or getattr(torch.version, "hip", None))


def _fork_allowed_here() -> bool:
    """Linux, and not turned off with ``DTRAIN_WORKER_START=exec``: the checks that need no torch."""
    return os.environ.get(START_ENV, "fork") != "exec" and sys.platform.startswith("linux")


def how_to_start(command: list[str] | WorkerModule) -> tuple[bool, Any, list[str]]:
    """(fork?, the agent's entrypoint, its arguments) for ``command``: dtrain's own worker forked from the fork
    server where :func:`can_fork` allows (the server started here), else a new interpreter running
    ``command``. A forked start uses the agent's ``forkserver`` start method, within :func:`forking`."""
    if not isinstance(command, WorkerModule):
        return False, sys.executable, command
    # A script's numpy sizes its BLAS pool at import: the server imported it with one thread, as an exec'd
    # worker does only where its slot has one thread (see above).
    one_thread = command.module != SCRIPT_WORKER or os.environ.get("OMP_NUM_THREADS") == "1"
    if not (one_thread and can_fork()):
        return False, sys.executable, command.command
    start_server(command.module)
    return True, ForkedMain(command), list(command.argv)


def start_early(module: str) -> None:
    """Start the fork server for ``module`` before this process imports torch, where it will very likely be
    used: its imports then run beside the launcher's instead of after them. Judged without importing torch
    (a ``+cpu`` build, by its installed metadata; not in a worker of torchrun or of ``srun``, which trains in
    place); :func:`how_to_start` still decides, and a server that ends up unused exits with this process."""
    if not _fork_allowed_here():
        return
    with contextlib.suppress(UserError):  # a malformed launcher environment: said by the run's preparation
        cluster = read_cluster_env()
        if cluster is not None and cluster.role == "worker":
            return
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return
    if version.endswith("+cpu"):
        start_server(module, here=True)


def preload_torch() -> None:
    """Import what torch itself would import in each worker: DDP's constructor reaches into
    ``torch._dynamo`` (about 1.5 s per process)."""
    importlib.import_module("torch._dynamo")


def start_server(module: str, here: bool = False) -> None:
    """Start this process's fork server, which imports torch and ``module`` once, unless it runs already.

    It returns once the server runs: the server imports while the launcher goes on, and the first fork
    waits for it. ``here``: a launcher that has not imported torch yet and has one thread imports it now and
    forks the server from itself (:func:`_fork_server_here`), else the server is a new interpreter.
    """
    global _server_env
    server = multiprocessing.forkserver._forkserver
    if _server_env is None:
        server.set_forkserver_preload([*SERVER_PRELOAD, module])
        atexit.register(_stop_server)
    if server._forkserver_pid is not None and not _is_child(server._forkserver_pid):
        # The server of the process this one was forked from (a notebook's fork, a forked test rank): not this
        # process's to wait for (multiprocessing's waitpid on it raised) or to stop; this one starts its own.
        server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
    before = server._forkserver_pid
    with _one_thread_libraries():
        if not (here and before is None and _fork_server_here(server)):
            # Also restarts a server that died (the user killed it).
            server.ensure_running()
        if server._forkserver_pid != before or _server_env is None:
            _server_env = dict(os.environ)


# The name (/proc/PID/comm) of a fork server forked from its launcher: its command line is the launcher's.
SERVER_NAME = "dtrain-forksrv"


def _fork_server_here(server: Any) -> bool:
    """Import torch here, then fork the fork server from this process: the server inherits that import (a
    second one cost about 2.5 s of CPU per launcher) and imports only the rest of its preload. Done only
    where it is as safe as a new interpreter: this process has one thread once torch is imported (a thread's
    held lock would be inherited held), and Python's fork server speaks the protocol written for here (a
    later Python's may differ: the new interpreter then). Only a process that has not imported torch yet: one
    that has (a test suite, a notebook, a tool running dtrain in its own process) may hold objects on
    descriptors that the server closes and reuses, or state a worker must not inherit. Whether the server
    was forked."""
    if "torch" in sys.modules:
        return False
    # The import the server shares. Within _one_thread_libraries: no thread pool, for the launcher too, whose
    # torch and numpy then run on one thread (it trains nothing).
    import torch  # noqa: F401

    if not (_only_thread() and _known_protocol(server)):
        return False
    from multiprocessing import connection, resource_tracker, util

    resource_tracker.ensure_running()
    address = connection.arbitrary_address("AF_UNIX")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server exits when the launcher's end closes (Python's protocol)
        for stream in (sys.stdout, sys.stderr):  # nothing written so far may be written again by a child
            with contextlib.suppress(Exception):
                stream.flush()
        gc.collect()  # no garbage left whose finalizer could close a descriptor the server reuses
        # No stop signal is handled between the fork and the server's own handlers: the launcher's (a SIGTERM
        # that raises Stopped, Ctrl-C's KeyboardInterrupt) would run the launcher's code in the server.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *STOP_SIGNALS})
        try:
            pid = os.fork()
        except OSError:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(alive_r)
            os.close(alive_w)
            return False
        if pid == 0:
            _serve(listener.fileno(), alive_r, server._preload_modules, blocked)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def _serve(listener_fd: int, alive_r: int, preload: list[str], mask: set[signal.Signals]) -> None:
    """The forked server: named as a helper of its launcher, with a new server's signal handlers, only the
    descriptors a new server would have and no resource tracker of its own, Python's own fork server; it
    never returns into the launcher's code. Stop signals are blocked on entry, until its handlers are set."""
    code = 1
    try:
        set_name(SERVER_NAME)  # first: until then the supervisor would count it as one of the workers
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as forkserver_init makes a new server do
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # A new server's streams, not what the launcher had put in their place at the fork (contextlib's
        # redirect, a caller capturing dtrain's output): torch's agent points a rank's output at its log by
        # descriptor, and a child holding an object without one failed before its first line.
        sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
        keep = {0, 1, 2, listener_fd, alive_r}
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        from multiprocessing import resource_tracker

        tracker = resource_tracker._resource_tracker  # the launcher's (its descriptor is closed above)
        tracker._fd = tracker._pid = None
        gc.freeze()  # the launcher's objects, inherited: never collected here (the docs' advice after fork)
        multiprocessing.forkserver.main(listener_fd, alive_r, preload)
        code = 0
    except SystemExit as stop:  # the launcher closed its end of the "alive" pipe
        code = stop.code if isinstance(stop.code, int) else 0
    finally:
        os._exit(code)


def _only_thread() -> bool:
    return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1


def _known_protocol(server: Any) -> bool:
    """Python's fork server as written for :func:`_fork_server_here` (3.10 to 3.13; 3.14's hands its clients
    a key): started with these arguments, its state in these attributes, no key to hand over."""
    params = list(inspect.signature(multiprocessing.forkserver.main).parameters)
    state = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_preload_modules")
    return (params == ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
            and all(hasattr(server, name) for name in state) and not hasattr(server, "_forkserver_authkey"))


@contextlib.contextmanager
def _one_thread_libraries() -> Iterator[None]:
    """Within: the environment of a fork server whose imports start no thread pool (numpy's BLAS starts one
    per core at import), and that is never profiled: a script's run directory in ``DTRAIN_PROFILE`` (set by
    an in-process ``dtrain launch`` before its first worker starts the server) would make the server start
    the script's profiling when it imports torch (``dtrain-profile.pth``). A worker gets its thread counts and
    its ``DTRAIN_PROFILE`` from the launcher's environment (see above)."""
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    saved = {name: os.environ.get(name) for name in (*names, PROFILE_ENV)}
    os.environ.update(dict.fromkeys(names, "1"))
    os.environ.pop(PROFILE_ENV, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _stop_server() -> None:
    """At this process's exit, stop its fork server at once: it notices the exit by itself only once its
    imports are done, seconds after a launcher that failed early, and meanwhile holds the launcher's standard
    streams (a caller reading them to the end waits). Its children, if any are left, die with it."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    if pid is not None and _is_child(pid):  # a forked copy of this process leaves its parent's server alone
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


def _is_child(pid: int) -> bool:
    """Whether ``pid`` is a child of this process (running or not yet waited for), by /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid()  # field 4, after the parenthesised name


def _without_main(name: str) -> dict[str, Any]:
    data = _preparation_data(name)
    data.pop("init_main_from_name", None)
    data.pop("init_main_from_path", None)
    return data


_preparation_data = multiprocessing.spawn.get_preparation_data


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Within: processes started by the fork server do not import the launcher's ``__main__`` (which
    ``multiprocessing`` does for a process that runs a function of it; a worker runs dtrain's)."""
    multiprocessing.spawn.get_preparation_data = _without_main
    try:
        yield
    finally:
        multiprocessing.spawn.get_preparation_data = _preparation_data


def _is_open(fd: int) -> bool:
    # (forkserver_init.identity's test, which the launcher cannot import: it ignores SIGINT on import)
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class ForkedMain:
    """The agent's entrypoint for forked workers: ``main(argv)`` of :attr:`worker`'s module.

    Sent to the fork server's child by pickle, which takes the launcher's environment at that moment.
    """

    def __init__(self, worker: WorkerModule) -> None:
        self.worker = worker
        # torch's agent names the entrypoint in its logs
        self.__name__ = self.__qualname__ = f"{worker.module}.main"
        self.launcher_env: dict[str, str] = {}
        self.server_env: dict[str, str] = {}
        self.launcher_streams: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Descriptors go with the child only while a fork server's child is being started (elsewhere
        # multiprocessing would serve them from a thread of this process).
        passing = multiprocessing.context.get_spawning_popen() is not None
        streams = {fd: multiprocessing.reduction.DupFd(fd) for fd in (1, 2) if passing and _is_open(fd)}
        return {**self.__dict__, "launcher_env": dict(os.environ), "server_env": dict(_server_env or {}),
                "launcher_streams": streams}

    def __call__(self, *argv: str) -> None:
        become_worker(self.launcher_env, self.server_env, self.launcher_streams)
        if self.worker.path is not None:
            sys.path[:] = self.worker.path
        main = importlib.import_module(self.worker.module).main
        try:
            main(list(argv))
        except KeyboardInterrupt:
            # torch's process wrapper would turn it into exit code 0, which the agent awaits a result for.
            raise SystemExit(128 + signal.SIGINT) from None
        finally:
            # What the worker registered (a script's own handlers, a logger's flush, the profiling session's)
            # runs as at a new interpreter's exit: multiprocessing's child leaves by os._exit, which skips them.
            atexit._run_exitfuncs()
