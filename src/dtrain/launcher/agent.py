"""Starting workers on PyTorch's own elastic agent (the engine behind ``torchrun``).

dtrain adds only what the agent does not do: a run directory, per-rank logs, and on failure one
readable line naming the failing rank and its root cause (:mod:`dtrain.engine.failures`) instead of the agent's
wall of text. Across machines, :mod:`dtrain.launcher.join` first brings the nodes together; this module then
starts each node's agent with what the join settled (:class:`~dtrain.launcher.join.NodeLaunch`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from dtrain.engine import watchdog
from dtrain.engine.failures import Failure, read_reports
from dtrain.launcher import cpu, exitbarrier, forkstart, membership
from dtrain.launcher.culprit import read_statuses, root_cause
from dtrain.launcher.elastic import ElasticSetup, JobStopped, Left, launch_elastic
from dtrain.launcher.join import JoinError, NodeLaunch, leave_last
from dtrain.launcher.supervise import Stopped, Supervisor


@dataclass(frozen=True)
class LaunchOptions:
    slots: int
    max_restarts: int = 0
    # A dtrain run directory: non-chief ranks' output goes to logs/agent/ there, and each rank's error
    # report to logs/. None (``dtrain launch``) leaves every rank on the console.
    run_dir: Path | None = None
    debug: bool = False
    # Multi-machine: how torch's agent meets the other nodes (None: this machine alone).
    nodes: NodeLaunch | None = None
    # Whether the workers stop cleanly on SIGUSR1 (dtrain's own worker; not a user's script), and how long
    # a signalled run may take to stop before its workers are killed.
    clean_stop: bool = False
    grace_seconds: float = 30.0
    # torch threads per worker (None: dtrain.launcher.cpu.for_run's rule, which respects the user's OMP_NUM_THREADS).
    threads: int | None = None
    # Where the run's checkpoints go (an elastic job records each membership change against them).
    checkpoints: Path | None = None


def _quiet_agent(debug: bool) -> None:
    # The agent logs every failure at ERROR with a long banner; dtrain prints the root cause instead.
    level = logging.INFO if debug else logging.CRITICAL
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run",
                 "torch.multiprocessing"):  # forked workers: the agent's process context logs there
        logging.getLogger(name).setLevel(level)


def _cheap_rendezvous_event_names() -> None:
    """torch's rendezvous names each of its events after the calling method by ``inspect.stack()``, which
    reads source lines and searches ``sys.modules`` for every frame (cpython#92041: slower as more modules
    are loaded): a large part of a single-node launch started from a deep call stack. The same
    name is one frame lookup away; torch's function is replaced only where it has the expected shape."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # inspect.stack()[depth]: frame 0 is this function
        except ValueError:  # a shallower stack
            return "no_method_name"

    if getattr(dynamic_rendezvous.get_method_name, "__name__", None) == "get_method_name":
        dynamic_rendezvous.get_method_name = get_method_name


def launch(command: list[str] | forkstart.WorkerModule, options: LaunchOptions) -> Failure | None:
    """Run ``command`` (a Python module or script and its args) on ``options.slots`` local workers.

    dtrain's own worker (a :class:`~dtrain.launcher.forkstart.WorkerModule`) is forked from a fork server that
    has imported torch where that is safe, which spares each worker torch's imports; anything else starts as
    a new interpreter.

    Returns None on success, else the first (root-cause) failure; raises :class:`~dtrain.launcher.supervise.Stopped`
    when a signal stopped the run.
    """
    _quiet_agent(options.debug)
    _cheap_rendezvous_event_names()
    # Set for every launch (not setdefault): bench and --verify launch several runs from one process, and
    # one run's value must not leak into the next (a 2-thread 1-slot value oversubscribing 2 slots).
    threads = options.threads
    if threads is None:
        threads, why = cpu.for_run(options.slots)
        if why is not None:  # the user's own setting oversubscribes: say so; fewer threads for busy cores: quietly
            logging.getLogger("dtrain").log(logging.WARNING if cpu.user_threads() else logging.INFO, "%s", why)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    logs_specs = DefaultLogsSpecs()
    nodes = options.nodes
    if options.run_dir is not None:
        log_dir = options.run_dir / "logs" / "agent"
        if nodes is not None:  # one folder per node: the agents' files would collide on shared storage
            log_dir = log_dir / nodes.log_name
        log_dir.mkdir(parents=True, exist_ok=True)
        # Rank 0 keeps the terminal (for its progress bar); the others write to files.
        logs_specs = DefaultLogsSpecs(
            log_dir=str(log_dir), redirects={r: Std.ALL for r in range(1, options.slots)}
        )
    if nodes is None:
        rdzv: dict[str, Any] = dict(min_nodes=1, max_nodes=1, run_id=f"dtrain-{uuid.uuid4().hex[:8]}",
                                    rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0")
    else:
        rdzv = dict(min_nodes=nodes.min_nodes, max_nodes=nodes.max_nodes, run_id=nodes.run_id,
                    rdzv_backend=nodes.rdzv_backend, rdzv_endpoint=nodes.rdzv_endpoint,
                    rdzv_configs=dict(nodes.rdzv_configs), local_addr=nodes.local_addr)
    fork, entrypoint, argv = forkstart.how_to_start(command)
    config = LaunchConfig(
        nproc_per_node=options.slots,
        start_method="forkserver" if fork else "spawn",  # (only function entrypoints have a start method)
        max_restarts=options.max_restarts,
        monitor_interval=0.1,
        logs_specs=logs_specs,
        # SIGINT and SIGTERM are the supervisor's (a clean stop); the agent keeps the rarer ones.
        signals_to_handle="SIGHUP,SIGQUIT",
        **rdzv,
    )
    elastic = _is_elastic(options)
    # A signalled node of an elastic job leaves it; the others go on (unless it hosts the rendezvous).
    leaves = elastic and nodes is not None and not nodes.is_host
    started = time.time()
    # A node joining a running job leaves the running ranks' statuses alone.
    with _status_dir(options.run_dir, keep=nodes is not None and nodes.late) as status_dir:
        # Workers die with this process (watchdog.die_with_launcher) and publish where they are here.
        os.environ[watchdog.LAUNCHER_PID_ENV] = str(os.getpid())
        os.environ[watchdog.STATUS_DIR_ENV] = str(status_dir)
        # An elastic node that is signalled leaves the job: the other nodes count it before they meet again.
        leaving = functools.partial(membership.note_leaving, status_dir, nodes.log_name, nodes.is_host) \
            if elastic and nodes is not None else None
        in_world = threading.Event()  # set by the elastic agent while this node belongs to a world the nodes met for
        try:
            with Supervisor(options.grace_seconds, options.clean_stop, status_dir, on_signal=leaving,
                            shared_world=elastic, in_world=in_world.is_set) as supervisor:
                try:
                    with forkstart.forking() if fork else contextlib.nullcontext(), \
                            _no_first_round_jitter() if nodes is None else contextlib.nullcontext():
                        if elastic:
                            launch_elastic(config, entrypoint, argv, _setup(options, status_dir, supervisor, in_world))
                        else:
                            with _worker_store_per_world(nodes), exitbarrier.in_torchs_launcher():
                                try:
                                    elastic_launch(config, entrypoint)(*argv)
                                finally:
                                    if nodes is not None:
                                        leave_last(nodes)
                except ChildFailedError as exc:
                    if supervisor.signum is None:
                        return _root_cause(exc, status_dir, options.slots if nodes is None else None)
                except Left:  # the others go on, unless this node served the rendezvous (then they stop too)
                    raise Stopped(supervisor.signum or signal.SIGTERM, clean=True, signalled_at=supervisor.signalled_at,
                                  left=nodes is not None and not nodes.is_host) from None
                except JobStopped as exc:
                    if _finished_since(options.run_dir, started):  # it ended while this node came to join it
                        logging.getLogger("dtrain").warning("the job finished before this node could join it")
                        return None
                    return Failure(0, 1, f"the job stopped: {exc}", user_error=False, standalone=True,
                                   clean_stop=True)
                except SignalException as exc:  # the agent stopped the workers (SIGHUP, SIGQUIT, or no grace left)
                    # An elastic node leaves all the same (not cleanly: the others continue from their state).
                    raise Stopped(int(exc.sigval), left=leaves, signalled_at=supervisor.signalled_at,
                                  no_workers=not supervisor.had_workers) from None
                except RendezvousError as exc:
                    # A node that passed dtrain's pre-rendezvous but never reached torch's (it died in between).
                    raise JoinError(f"torch's rendezvous at {nodes.rdzv_endpoint if nodes else 'localhost'} failed: "
                                    f"{exc}; check that every node is still running") from None
            if supervisor.signum is not None:
                raise Stopped(supervisor.signum, signalled_at=supervisor.signalled_at, left=leaves)
        finally:
            os.environ.pop(watchdog.LAUNCHER_PID_ENV, None)
            os.environ.pop(watchdog.STATUS_DIR_ENV, None)
    return None


def _finished_since(run_dir: Path | None, since: float) -> bool:
    """Whether the run's summary (written once it reached max_length) was written after ``since``."""
    summary = run_dir / "summary.json" if run_dir is not None else None
    return summary is not None and summary.is_file() and summary.stat().st_mtime >= since


def _is_elastic(options: LaunchOptions) -> bool:
    """Whether nodes may come and go while the job runs: a c10d node range, dtrain's own workers."""
    # dtrain's elastic agent asks every rank to stop at one batch with a checkpoint (SIGUSR1, answered by the
    # engine's stop vote) before a membership change, and the new world resumes from it. A user's script
    # (dtrain launch: no clean_stop, no run directory) honours neither, so its node range stays with torch's
    # own agent: a change restarts every worker, and the script resumes from whatever it saved, as under torchrun.
    nodes = options.nodes
    return (nodes is not None and nodes.rdzv_backend == "c10d" and nodes.min_nodes < nodes.max_nodes
            and options.clean_stop and options.run_dir is not None)


def _setup(options: LaunchOptions, status_dir: Path, supervisor: Supervisor, in_world: threading.Event) -> ElasticSetup:
    nodes, run_dir = options.nodes, options.run_dir
    assert nodes is not None and run_dir is not None
    return ElasticSetup(run_dir=run_dir, logs=status_dir, ckpt_root=options.checkpoints or run_dir / "checkpoints",
                        node=nodes.log_name, min_nodes=nodes.min_nodes, is_host=nodes.is_host, late=nodes.late,
                        grace_seconds=options.grace_seconds, signalled=lambda: supervisor.signalled_at,
                        endpoint=nodes.rdzv_endpoint, in_world=in_world)


@contextlib.contextmanager
def _worker_store_per_world(nodes: NodeLaunch | None) -> Iterator[None]:
    """Within, for a node range under torch's own agent (a script's elastic job): each world's first worker
    serves its own store, as in dtrain's elastic agent. With the agent's shared store, torch publishes the
    store's address in its first round only, so a node that joins later waits for it in vain and the job
    fails after a minute (tests/launcher/test_launch_nodes.py met it)."""
    key = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    if nodes is None or nodes.rdzv_backend != "c10d" or nodes.min_nodes == nodes.max_nodes:
        yield
        return
    previous = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


@contextlib.contextmanager
def _no_first_round_jitter() -> Iterator[None]:
    """Within: torch's c10d rendezvous does not sleep its random 0-0.3 s before its first round. The pause
    spreads many nodes' first attempts on a shared store; a run on this machine alone meets only itself in a
    store of its own, so it only delayed every local run (by 0.15 s on average). Its other pauses (a poll's
    one second) stay: a random pause is the only kind given as a range."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    real = getattr(dynamic_rendezvous, "_delay", None)
    if real is None:
        yield
        return

    def delay(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):
            real(seconds)

    dynamic_rendezvous._delay = delay
    try:
        yield
    finally:
        dynamic_rendezvous._delay = real


@contextlib.contextmanager
def _status_dir(run_dir: Path | None, keep: bool = False) -> Iterator[Path]:
    """Where ranks publish their status and error reports: the run's logs/, else a temporary folder.
    A previous attempt's statuses are removed, unless ``keep`` (they belong to a job that is running)."""
    if run_dir is not None:
        logs = run_dir / "logs"
        for stale in [] if keep else logs.glob(watchdog.STATUS_FILE.format(rank="*")):
            stale.unlink(missing_ok=True)
        yield logs
        return
    with tempfile.TemporaryDirectory(prefix="dtrain-launch-") as tmp:
        yield Path(tmp)


def _root_cause(exc: ChildFailedError, status_dir: Path, world_size: int | None) -> Failure:
    """The one failure to show: see :func:`dtrain.launcher.culprit.root_cause`."""
    found = root_cause(exc.failures, read_reports(status_dir, own_ranks=set(exc.failures)), read_statuses(status_dir),
                       world_size)
    if found is not None:
        return found
    rank, failure = exc.get_first_failure()
    return Failure(rank, 1, f"exited with code {failure.exitcode}", user_error=False)
