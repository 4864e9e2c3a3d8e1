"""The agents' exit barrier, left as soon as waiting for it is pointless.

Once its workers have finished, every node's agent waits until every other node's have (torch's exit barrier:
the node that hosts the job's store must outlive the others' use of it). torch waits in one store call of
``exit_barrier_timeout`` (300 s) that no signal interrupts. A node whose worker failed after this node's had
finished never arrives there (its agent closes the job instead), so this node sat out the whole 300 s, a SIGTERM
meanwhile taking effect only at their end. Here the same barrier (torch's keys, so torch's own agents meet it too)
is waited for in short steps, each followed by a look at whether the job ended elsewhere: a node whose workers
failed marks the agents' store so (a fixed-size job's static rendezvous has no closed state), and an elastic job's
rendezvous is closed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.utils.store import _barrier_nonblocking

log = logging.getLogger(__name__)
# How often the barrier is looked at: a step's latency at every job's end, one store request per node each time.
STEP_SECONDS = 0.25
# Set in the agents' store by a node whose workers failed for good (its agent never comes to the barrier).
FAILED_KEY = _TERMINAL_STATE_SYNC_ID + "/failed"
# Counted by each agent once it has seen every agent arrive.
SEEN_KEY = _TERMINAL_STATE_SYNC_ID + "/seen"
# The longest an agent waits, once all arrived, for the others to have seen it too.
LINGER_SECONDS = 10.0


def wait_for_peers(store: Any, world_size: int, closed: Callable[[], bool], timeout: float,
                   step: float = STEP_SECONDS) -> str:
    """Arrive at the exit barrier and wait for the other agents: ``"met"``; ``"closed"``, the job ended on
    another node first (no one else is coming); ``"gone"``, the store's host went away; or ``"timeout"``.
    Between looks it sleeps in Python, where a stop signal is handled at once (a store's blocking wait is not
    interrupted)."""
    try:
        last = _barrier_nonblocking(store, world_size, _TERMINAL_STATE_SYNC_ID)
        deadline = time.monotonic() + timeout
        while not store.check([last]):
            if closed():
                return "closed"
            if time.monotonic() >= deadline:
                return "timeout"
            time.sleep(step)
    except DistError:
        return "gone"
    # Every agent arrived. The node hosting the store (whichever it is) leaves only once every other has seen
    # that too: one that had not would find the store gone at its next look, where torch's blocking wait was
    # told at once.
    with contextlib.suppress(DistError):  # the host left: every agent had seen it
        store.add(SEEN_KEY, 1)
        lingering = time.monotonic() + LINGER_SECONDS
        while store.add(SEEN_KEY, 0) < world_size and time.monotonic() < lingering:
            time.sleep(step / 5)
    return "met"


class ExitBarrier:
    """For torch's agent: its ``_exit_barrier`` waited for by :func:`wait_for_peers`."""

    _store: Any
    _worker_group: Any
    _exit_barrier_timeout: float
    _in_exit_barrier: bool

    def _invoke_run(self, role: str = "default") -> Any:
        result = super()._invoke_run(role)  # type: ignore[misc]
        if result.is_failed():  # no restart left: this node's agent will not come to the others' barrier
            with contextlib.suppress(Exception):
                self._store.set(FAILED_KEY, str(self._worker_group.group_rank))
        return result

    def _exit_barrier(self) -> None:
        group, store = self._worker_group, self._store
        self._in_exit_barrier = True  # torch's flag: its health check counts this wait as progress
        try:
            found = wait_for_peers(store, group.group_world_size, lambda: _ended(store, group.spec.rdzv_handler),
                                   self._exit_barrier_timeout)
        finally:
            self._in_exit_barrier = False
        if found == "closed":
            log.warning("the job ended on another node while this one's workers had finished: not waiting for it")
        elif found == "gone":
            log.warning("the node hosting the job's store went away while this one waited for the others to finish")
        elif found == "timeout":
            log.error("the other nodes' workers did not finish within %.0f s of this node's",
                      self._exit_barrier_timeout)


def _ended(store: Any, handler: Any) -> bool:
    """Whether the job ended on another node: its workers failed, or the rendezvous was closed; a store that
    no longer answers counts too (its host went)."""
    try:
        return bool(store.check([FAILED_KEY]) or handler.is_closed())
    except Exception:  # the rendezvous's own errors, or the store's connection gone
        return True


class Agent(ExitBarrier, LocalElasticAgent):
    """torch's local agent with this exit barrier, for a job torch's own launcher runs (:func:`in_torchs_launcher`);
    dtrain's elastic agent (:mod:`dtrain.launcher.elastic`) has it too."""


@contextlib.contextmanager
def in_torchs_launcher() -> Iterator[None]:
    """Within: torch's ``launch_agent`` (``elastic_launch``) starts :class:`Agent` in place of its own."""
    from torch.distributed.launcher import api

    real = api.LocalElasticAgent
    api.LocalElasticAgent = Agent  # type: ignore[misc]
    try:
        yield
    finally:
        api.LocalElasticAgent = real  # type: ignore[misc]
