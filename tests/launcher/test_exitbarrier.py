"""The agents' exit barrier (dtrain.launcher.exitbarrier), in one process on torch's own store: met when every
node arrives, left within a step once the job ended elsewhere (a node's workers failed for good, or the
rendezvous closed), and given up at its timeout."""

import time

from torch.distributed import DistNetworkError, HashStore
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
from torch.distributed.elastic.utils.store import _barrier_nonblocking

from dtrain.launcher.exitbarrier import LINGER_SECONDS, SEEN_KEY, ExitBarrier, _ended, wait_for_peers


def test_every_node_arrived_is_met_at_once():
    store = HashStore()
    _barrier_nonblocking(store, 2, _TERMINAL_STATE_SYNC_ID)  # the other node's agent, there first
    store.add(SEEN_KEY, 1)  # and it has seen this one arrive: this one need not linger for it
    started = time.monotonic()
    assert wait_for_peers(store, 2, closed=lambda: False, timeout=60, step=0.05) == "met"
    assert store.add(SEEN_KEY, 0) == 2 and time.monotonic() - started < LINGER_SECONDS


def test_a_store_whose_host_went_away_ends_the_wait():
    class Gone:
        def add(self, key: str, value: int) -> int:
            raise DistNetworkError("Connection was likely closed")

    assert wait_for_peers(Gone(), 2, closed=lambda: False, timeout=60, step=0.05) == "gone"


def test_a_job_closed_elsewhere_is_left_within_a_step_not_at_the_timeout():
    """The other node's worker failed after this node's finished: its agent closed the job and never comes."""
    looks: list[float] = []

    def closed() -> bool:
        looks.append(time.monotonic())
        return len(looks) >= 3

    started = time.monotonic()
    assert wait_for_peers(HashStore(), 2, closed, timeout=300, step=0.05) == "closed"
    assert len(looks) == 3 and time.monotonic() - started < 30


def test_nobody_coming_and_nothing_closed_gives_up_at_the_timeout():
    assert wait_for_peers(HashStore(), 2, closed=lambda: False, timeout=0.2, step=0.05) == "timeout"


def test_the_agents_barrier_asks_its_rendezvous_and_counts_as_progress_meanwhile():
    """A store that no longer answers (its host went) counts as a closed job; torch's health flag is set only
    while waiting."""
    seen: list[bool] = []

    class Handler:
        def is_closed(self) -> bool:
            seen.append(agent._in_exit_barrier)
            raise ConnectionError("the store's host is gone")

    class Spec:
        rdzv_handler = Handler()

    class Group:
        group_world_size = 2
        spec = Spec()

    agent = ExitBarrier()
    agent._store, agent._worker_group = HashStore(), Group()
    agent._exit_barrier_timeout, agent._in_exit_barrier = 300, False
    started = time.monotonic()
    agent._exit_barrier()
    assert seen == [True] and agent._in_exit_barrier is False and time.monotonic() - started < 30


def test_torchs_own_launcher_starts_the_agent_with_this_barrier_within_and_its_own_after():
    """A script's fixed-size job on several nodes runs under torch's elastic_launch, which starts its own agent."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    from dtrain.launcher.exitbarrier import Agent, in_torchs_launcher

    with in_torchs_launcher():
        assert api.LocalElasticAgent is Agent and issubclass(Agent, LocalElasticAgent)
    assert api.LocalElasticAgent is LocalElasticAgent


def test_a_node_whose_workers_failed_for_good_ends_the_others_barrier():
    """A fixed-size job's static rendezvous has no closed state: the failed node's agent marks the store."""
    from types import SimpleNamespace

    class Failed:
        def _invoke_run(self, role: str = "default") -> SimpleNamespace:
            return SimpleNamespace(is_failed=lambda: True)

    class FailingNode(ExitBarrier, Failed):
        pass

    store = HashStore()
    never_closed = SimpleNamespace(is_closed=lambda: False)
    assert not _ended(store, never_closed)
    node = FailingNode()
    node._store, node._worker_group = store, SimpleNamespace(group_rank=1)
    assert node._invoke_run().is_failed()
    assert _ended(store, never_closed)
    assert wait_for_peers(store, 2, lambda: _ended(store, never_closed), timeout=300, step=0.05) == "closed"
