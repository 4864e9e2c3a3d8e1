"""Elastic jobs (``--nnodes MIN:MAX --rdzv-backend c10d``): membership changes that lose no work.

torch's c10d rendezvous and elastic agent do the membership: a node that arrives while the job runs waits
in the rendezvous, every agent sees it (``num_nodes_waiting``) and restarts its workers, and the nodes
meet again at the new size. Left alone, the agent SIGTERMs the workers mid-step, and a node that leaves
closes the rendezvous for everyone (``launch_agent`` shuts it down on the way out). :class:`ElasticAgent`
is torch's ``LocalElasticAgent`` with the steps dtrain needs in between:

* **join**: before torch restarts the workers, this node's workers get the clean-stop request (SIGUSR1,
  :mod:`dtrain.engine.stopping`): every rank of the job stops at one agreed batch, writes a checkpoint there
  and exits 0. The new world resumes from that checkpoint (the run directory's latest,
  :func:`dtrain.engine.worker.resume_point`) at the new world size, with the same global batch.
* **leave**: SIGTERM or SIGINT to one node's launcher stops every rank the same way (its supervisor asks its
  workers, whose vote stops them all). That node then leaves the rendezvous round and exits; the agents
  of the other nodes see their workers stopped, not finished, and meet again without it, down to
  ``MIN`` nodes. Below it, or when the node hosting the rendezvous (whose process serves its store) is
  the one that left, the job stops there, resumable.
* **lost**: a node killed outright cannot stop cleanly. The others' workers fail on their next collective
  with a peer's connection error only; then the agents restart them without counting it against
  ``max_restarts``, the rendezvous drops the dead node once its heartbeats expire, and the job continues
  from the latest checkpoint.

Each change is written down once the new world has trained a step (:mod:`dtrain.launcher.membership`).
:func:`launch_elastic` runs the agent as torch's ``launch_agent`` would, except that a node that leaves
takes itself out of the rendezvous instead of closing it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import DistStoreError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout
from torch.distributed.launcher.api import LaunchConfig

from dtrain.dist import hold_port
from dtrain.engine import survivor
from dtrain.engine.failures import ERROR_FILE, is_secondary
from dtrain.engine.watchdog import STATUS_FILE
from dtrain.launcher import membership
from dtrain.launcher.exitbarrier import ExitBarrier

log = logging.getLogger("dtrain")

# A dead node leaves the rendezvous once it missed this many heartbeats this far apart (torch: 5 s x 3).
KEEP_ALIVE_SECONDS = 2
KEEP_ALIVE_ATTEMPTS = 3
_POLL_SECONDS = 0.1
_NODE_KEY = "dtrain/node/{group_rank}"
# The rendezvous's last call after a lost node or a leave (the usual one, 5 s, lets nodes that start together
# meet).
LOST_LAST_CALL_SECONDS = 2


@dataclass(frozen=True)
class ElasticSetup:
    """What the agent needs of the run: where ranks publish their status, this node, the rules."""

    run_dir: Path
    logs: Path
    ckpt_root: Path
    node: str  # this node's name in records (unique within the job)
    min_nodes: int
    is_host: bool  # this node's launcher serves the rendezvous store: when it leaves, the job stops
    late: bool  # it arrived while the job was running
    grace_seconds: float
    signalled: Callable[[], float | None]  # when this node's launcher got SIGTERM/SIGINT (None: not)
    endpoint: str = ""  # the rendezvous's host:port (served by the host node's launcher)
    # Set while this node belongs to a world the nodes met for (its workers are forked, starting or running);
    # clear while it meets the others. The supervisor reads it for a signal that finds no worker yet.
    in_world: threading.Event = dataclasses.field(default_factory=threading.Event)


class Left(Exception):
    """This node left the job on a signal, after every rank stopped at one batch with a checkpoint."""


class JobStopped(Exception):
    """The job cannot continue at any size (too few nodes remain, the rendezvous host left, or the job ended
    elsewhere while this node waited); every rank stopped at the latest checkpoint."""


class HostLost(JobStopped):
    """The node that served the rendezvous went away: nobody is left to meet at (its store is gone)."""


class ElasticAgent(ExitBarrier, LocalElasticAgent):
    """torch's local agent, with a clean stop at an agreed batch before every membership change, and an exit
    barrier left as soon as the job ends elsewhere (:mod:`dtrain.launcher.exitbarrier`)."""

    def __init__(self, spec: WorkerSpec, logs_specs: Any, start_method: str, setup: ElasticSetup) -> None:
        super().__init__(spec, logs_specs, start_method=start_method)
        self.setup = setup
        self.recorder = membership.ChangeRecorder(setup.run_dir, setup.logs, setup.ckpt_root)
        self.nodes: list[str] = []  # this world's nodes, by group rank
        self._previous: list[str] = []
        self._world_started = time.time()
        self._first = True
        self._ended: RunResult | None = None  # the workers finished during a clean stop
        self._usual_settings: Any = None  # the rendezvous's settings while a short last call replaces them

    # -------------------------------------------------------------------------------- torch's steps
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        try:  # (the world counts as met once torch's round is complete: launch_elastic's _marking)
            try:
                super()._rendezvous(worker_group)
            except DistStoreError:
                # A node stopped by a signal just as the round completed (before it saw so) never says how many
                # workers it starts: torch's wait for it times out. The others meet again, without it.
                log.warning("%s: a node of the round went away before it started its workers; meeting the other "
                            "nodes again", self.setup.node)
                super()._rendezvous(worker_group)
        finally:
            self._restore_last_call(worker_group)
        # Every agent names itself in this round's store (prefixed by the round): who joined, who went away.
        store = worker_group.store
        store.set(_NODE_KEY.format(group_rank=worker_group.group_rank), self.setup.node)
        self._previous = self.nodes
        self.nodes = [store.get(_NODE_KEY.format(group_rank=r)).decode() for r in range(worker_group.group_world_size)]

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        joining = self._first and self.setup.late
        if joining:
            membership.note_event(self.setup.logs, "join", self.setup.node)
        self._first = False
        self._forget_statuses(worker_group)
        super()._initialize_workers(worker_group)
        self._world_started = time.time()
        workers = worker_group.workers
        gone = [n for n in self._previous if n not in self.nodes]
        if joining:
            self._say(f"joined the running job; training at world size {workers[0].world_size} on "
                      f"{len(self.nodes)} node(s)")
        elif self._previous and self._previous != self.nodes:
            came = [n for n in self.nodes if n not in self._previous]
            parts = ([f"joined: {', '.join(came)}"] if came else []) + ([f"gone: {', '.join(gone)}"] if gone else [])
            self._say(f"the job now runs on {len(self.nodes)} node(s), world size {workers[0].world_size} "
                      f"({'; '.join(parts)})")
        rank0 = workers[0].id if worker_group.group_rank == 0 else None
        self.recorder.started(worker_group.group_rank, workers[0].world_size, rank0, gone, self.nodes)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """torch restarts the workers: nodes wait to join (the group is healthy), or they failed with restarts
        left. For a join, every rank first stops at an agreed batch with a checkpoint."""
        if worker_group.state == WorkerState.HEALTHY:
            result = self._clean_stop(worker_group)
            phases = self._local_phases(worker_group)
            if result is not None and result.state == WorkerState.SUCCEEDED and phases == {"finished"}:
                self._ended = result  # the run ended meanwhile: torch's next look at the workers says so
                return
            if result is not None and result.state == WorkerState.SUCCEEDED and phases == {"stopped"}:
                self._continue_after_stop(worker_group)
                return
        self._restart(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._ended is not None:
            return self._ended
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.SUCCEEDED and self._local_phases(worker_group) == {"stopped"}:
            # Stopped, not finished: another node's stop request (a join it saw first, or it is leaving),
            # or this node's own signal.
            self._continue_after_stop(worker_group)
            return RunResult(state=WorkerState.HEALTHY)
        if result.state == WorkerState.FAILED and self._peer_lost(worker_group, result):
            self._await_survivors(worker_group)
            if not self.setup.is_host and not _reachable(self.setup.endpoint):
                raise HostLost(f"the node hosting the rendezvous ({self.setup.endpoint}) went away, and the "
                               "rendezvous with it: the other nodes cannot meet again")
            self._quick_last_call(worker_group)
            self.recorder.poll()  # the previous change, if its world's first step went unseen
            last = membership.last_batch(self.setup.logs)
            membership.note_event(self.setup.logs, "lost", "a node", last_batch=last)
            log.warning("%s: a peer's connection failed (a node went away?); meeting the other nodes again",
                        self.setup.node)
            self._restart(worker_group)
            return RunResult(state=WorkerState.HEALTHY)
        if result.state == WorkerState.HEALTHY:
            self.recorder.poll()
        return result

    def _quick_last_call(self, worker_group: WorkerGroup) -> None:
        """After a lost node nobody is expected to arrive: the survivors, already waiting when its heartbeats
        expire, meet after a short last call rather than the one that lets starting nodes gather. torch has
        no public setting per round: its executor's settings are replaced where they have the expected shape."""
        executor = getattr(worker_group.spec.rdzv_handler, "_op_executor", None)
        settings = getattr(executor, "_settings", None)
        timeout = getattr(settings, "timeout", None)
        if settings is None or not isinstance(timeout, RendezvousTimeout) or self._usual_settings is not None:
            return
        last_call = min(timedelta(seconds=LOST_LAST_CALL_SECONDS), timeout.last_call)  # never longer than set
        quick = RendezvousTimeout(join=timeout.join, last_call=last_call,
                                  close=timeout.close, heartbeat=timeout.heartbeat)
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            executor._settings = dataclasses.replace(settings, timeout=quick)
            self._usual_settings = settings

    def _restore_last_call(self, worker_group: WorkerGroup) -> None:
        if self._usual_settings is not None:
            executor = getattr(worker_group.spec.rdzv_handler, "_op_executor", None)
            with contextlib.suppress(AttributeError):
                executor._settings = self._usual_settings  # type: ignore[union-attr]
            self._usual_settings = None

    def _say(self, what: str) -> None:
        """One line on this node's console (stdout, beside the membership records): not a warning, news."""
        print(f"dtrain: {self.setup.node}: {what}", flush=True)

    # ------------------------------------------------------------------------------------ the steps
    def _restart(self, worker_group: WorkerGroup) -> None:
        """Stop what is left of the workers, meet the other nodes again, start the new world's workers."""
        super()._restart_workers(worker_group)

    def _continue_after_stop(self, worker_group: WorkerGroup) -> None:
        """Every rank stopped at one batch with a checkpoint: leave (this node was signalled), stop the job
        (it cannot go on without the nodes that leave), or meet the remaining and new nodes again."""
        signalled = self.setup.signalled()
        # A change whose world stopped before this agent saw its first step is written now, so that the next
        # cause can be noted (one change at a time): also where this node, the new world's first, leaves.
        self.recorder.poll()
        if signalled is not None:
            membership.note_event(self.setup.logs, "leave", self.setup.node, when=signalled)
            self._say("every rank stopped at one batch with a checkpoint; leaving the job")
            raise Left(self.setup.node)
        # Only this world's nodes: one signalled while it came to join (this stop was for it) is not in it.
        leaving = [r for r in membership.leaving_since(self.setup.logs, self._world_started) if r["node"] in self.nodes]
        names = ", ".join(sorted(str(r["node"]) for r in leaving))
        if leaving:  # the leaving node notes it too; whichever is first
            membership.note_event(self.setup.logs, "leave", names, when=min(float(r["time"]) for r in leaving))
        if any(r.get("hosts_store") for r in leaving):
            raise JobStopped(f"the node hosting the rendezvous ({names}) left the job, and the rendezvous with it")
        remaining = worker_group.group_world_size - len(leaving)
        if remaining < self.setup.min_nodes:
            raise JobStopped(f"{names} left the job: {remaining} node(s) remain, fewer than --nnodes's minimum "
                             f"{self.setup.min_nodes}")
        if leaving:  # as after a lost node: the remaining nodes, stopped together, are already on their way
            self._quick_last_call(worker_group)
        self._restart(worker_group)

    def _clean_stop(self, worker_group: WorkerGroup) -> RunResult | None:
        """Ask this node's workers to stop at an agreed batch (their vote stops every rank of the job) and
        wait for them to exit, within the grace period; how they ended (None: still running, or not asked).
        A worker still starting has trained nothing since the latest checkpoint: then torch's own stop is as
        good."""
        pids = [w.id for w in worker_group.workers]
        statuses = self._statuses()
        if not pids or any(statuses.get(pid, {}).get("batch") is None for pid in pids):
            return None
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + self.setup.grace_seconds
        while time.monotonic() < deadline:
            # torch's own look at the workers: a forked worker exits only once the agent has read its result.
            result = super()._monitor_workers(worker_group)
            if result.state != WorkerState.HEALTHY:
                return result
            time.sleep(_POLL_SECONDS)
        return None

    def _await_survivors(self, worker_group: WorkerGroup) -> None:
        """Let every local worker keep its state before any is stopped (:mod:`dtrain.engine.survivor`):
        each votes, saved or not, then exits; one that does not within the grace period is stopped anyway
        (a checkpoint is committed whole or not at all)."""
        workers = worker_group.workers
        if not workers:
            return
        deadline = time.monotonic() + self.setup.grace_seconds
        while time.monotonic() < deadline:
            voted = survivor.voters(self.setup.logs)
            if all(w.id in voted for w in workers):
                return
            time.sleep(_POLL_SECONDS)

    def _peer_lost(self, worker_group: WorkerGroup, result: RunResult) -> bool:
        """Whether every local worker failed only because a peer's connection closed (a node went away):
        each left an error report saying so. Their reports are consumed: this is no failure of the run."""
        if worker_group.group_world_size < 2:
            return False
        paths = [self.setup.logs / ERROR_FILE.format(rank=rank) for rank in result.failures]
        messages = []
        for path in paths:
            try:
                messages.append(str(json.loads(path.read_text()).get("message", "")))
            except (OSError, ValueError, AttributeError):
                return False
        if not messages or not all(is_secondary(m) for m in messages):
            return False
        # Another node's rank that failed on its own (its report says why) is a failure of the run, not a loss.
        for path in self.setup.logs.glob(ERROR_FILE.format(rank="*")):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                if path not in paths and not is_secondary(str(json.loads(path.read_text()).get("message", ""))):
                    return False
        for path in paths:
            path.unlink(missing_ok=True)
        return True

    # ------------------------------------------------------------------------------ worker statuses
    def _statuses(self) -> dict[int, dict[str, Any]]:
        """pid -> the status every worker of this run directory last published."""
        found: dict[int, dict[str, Any]] = {}
        for path in self.setup.logs.glob(STATUS_FILE.format(rank="*")):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                record = json.loads(path.read_text())
                found[int(record["pid"])] = record
        return found

    def _local_phases(self, worker_group: WorkerGroup) -> set[str]:
        """The phases this node's workers last published (``stopped``: at an agreed batch, ``finished``)."""
        statuses = self._statuses()
        return {str(statuses.get(w.id, {}).get("phase", "unknown")) for w in worker_group.workers}

    def _forget_statuses(self, worker_group: WorkerGroup) -> None:
        """Remove this node's previous workers' statuses: a rank of the old world may not exist in the new."""
        for worker in worker_group.workers:
            path = self.setup.logs / STATUS_FILE.format(rank=worker.global_rank)
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                if worker.id is not None and int(json.loads(path.read_text())["pid"]) == worker.id:
                    path.unlink()


def launch_elastic(config: LaunchConfig, entrypoint: Any, args: list[str], setup: ElasticSetup) -> None:
    """torch's ``launch_agent`` with :class:`ElasticAgent`; raises :class:`Left` when this node left the job
    (the rendezvous stays open for the others), ChildFailedError on a failure, JobStopped."""
    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                                  min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
                                  **{"keep_alive_interval": KEEP_ALIVE_SECONDS,
                                     "keep_alive_max_attempt": KEEP_ALIVE_ATTEMPTS, **config.rdzv_configs})
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    # Each world's first worker serves its own store: the agent's shared one would keep the previous world's
    # Gloo addresses under the same keys (the restart count does not change on a membership change).
    previous = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ[survivor.ENABLE_ENV] = "1"  # a lost node: the survivors keep their state (dtrain.engine.survivor)
    handler = rdzv_registry.get_rendezvous_handler(params)
    handler.num_nodes_waiting = _tolerant(handler.num_nodes_waiting)  # type: ignore[method-assign]
    port_hold = WorkerPortHold(handler.next_rendezvous)
    handler.next_rendezvous = _marking(port_hold, setup.in_world)  # type: ignore[method-assign]
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                      args=tuple(args), rdzv_handler=handler, max_restarts=config.max_restarts,
                      monitor_interval=config.monitor_interval, local_addr=config.local_addr)
    agent = ElasticAgent(spec, config.logs_specs, str(config.start_method), setup)
    close = True
    try:
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name="dtrain.engine.worker", failures=result.failures)
    except Left:
        close = False
        _leave_round(handler)
        raise
    except HostLost:
        close = False  # its store is gone: closing it would only fail (and print torch's C++ trace)
        _stop_heartbeats(handler)
        raise
    except RendezvousClosedError:
        raise JobStopped("the job ended on another node while this one waited to meet the others (it finished, "
                         "or failed: see that node's output)") from None
    except SignalException:
        close = False  # torch's rule: a node stopped by a signal does not end the job for the others
        # Out of the round it may be in: the others then meet without it at once, rather than wait for it in
        # a round it joined (torch's rank assignment would wait 60 s for it, then fail their agents).
        _leave_round(handler)
        raise
    finally:
        port_hold.release()
        os.environ.pop(survivor.ENABLE_ENV, None)
        if close:
            with contextlib.suppress(Exception):
                handler.shutdown()
        if previous is None:
            os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        else:
            os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = previous


class WorkerPortHold:
    """Keeps the port the first node's agent chose for its first worker's store (:func:`dtrain.dist.hold_port`)
    until the next rendezvous or the end: without the shared agent store, torch's rendezvous picks a free
    port and lets it go at once, and the worker binds it seconds later (once, in a CI run, another
    connection had taken it meanwhile)."""

    __slots__ = ("_held", "_next_rendezvous")

    def __init__(self, next_rendezvous: Callable[[], Any]) -> None:
        self._next_rendezvous = next_rendezvous
        self._held: socket.socket | None = None

    def __call__(self) -> Any:
        self.release()  # the previous world's workers have stopped: their store is gone
        found = self._next_rendezvous()
        if found.rank == 0 and found.bootstrap_store_info is not None:
            self._held = hold_port(found.bootstrap_store_info.master_port)
        return found

    @property
    def port(self) -> int | None:
        """The port held now (None: none)."""
        return None if self._held is None else int(self._held.getsockname()[1])

    def release(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None


def _marking(next_rendezvous: Callable[[], Any], in_world: threading.Event) -> Callable[[], Any]:
    """torch's agent meets the other nodes (``next_rendezvous``), then exchanges with them how many workers
    each starts: from the moment the round is complete, this node belongs to the world, and a signal then
    waits for its workers (:class:`dtrain.launcher.supervise.Supervisor`) rather than stopping it midway."""

    def meet() -> Any:
        in_world.clear()
        found = next_rendezvous()
        in_world.set()
        return found

    return meet


def _tolerant(num_nodes_waiting: Callable[[], int]) -> Callable[[], int]:
    """torch's agent asks the rendezvous between two looks at healthy workers whether nodes wait to join. When
    the node hosting it has just died, that question fails first, and the agent would leave at once: while
    this node's workers, about to fail on the dead peer, save the state they hold (dtrain.engine.survivor).
    Unanswered, nobody is taken to wait; the workers' failure then says what happened."""

    def asked() -> int:
        try:
            return num_nodes_waiting()
        except RendezvousConnectionError:
            return 0

    return asked


def _reachable(endpoint: str, timeout: float = 2.0) -> bool:
    """Whether anything answers at ``host:port`` (the rendezvous's store); a plain TCP connection, so that a
    dead store is told without torch's store client (which prints a C++ stack trace as it fails)."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        return True  # not known here: torch's rendezvous will tell
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _stop_heartbeats(handler: Any) -> None:
    """Stop the rendezvous's keep-alive thread and wait for it, before this process exits without closing the
    rendezvous. Left running, it is a daemon thread that may be inside torch's C++ store client when the
    interpreter exits, and then the process aborts ("terminate called without an active exception", exit
    status -6) after dtrain has said why it stopped. Once the node serving the store is dead, every heartbeat
    fails there (tests/launcher/test_elastic.py met it). torch's handler has no public call for it."""
    stop = getattr(handler, "_stop_heartbeats", None)
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()


def _leave_round(handler: Any) -> None:
    """Take this node out of the rendezvous round, so the others meet again at once rather than after its
    heartbeats expire. torch has no public call for it (``shutdown`` closes the rendezvous for everyone):
    the rendezvous's own exit step, where this torch has it."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    _stop_heartbeats(handler)  # first: the exit step may fail (a store gone), the thread must stop anyway
    executor = getattr(handler, "_op_executor", None)
    exit_op = getattr(dynamic_rendezvous, "_RendezvousExitOp", None)
    if executor is None or exit_op is None:
        return
    with contextlib.suppress(Exception):
        executor.run(exit_op(), time.monotonic() + 10)
