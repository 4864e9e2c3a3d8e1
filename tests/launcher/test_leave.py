"""A node of an elastic job stopped by a signal leaves; it never turns into a crash for the other nodes.

Found by a user: a node signalled as its workers started (just after it joined, or as a new world began)
killed them at once (a worker that has trained nothing since the last checkpoint costs nothing to kill, on
one node), and the workers of the other nodes, in the same world, failed with "connection reset". In-process
here: the supervisor and one stand-in worker process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dtrain.launcher import supervise
from dtrain.launcher.supervise import Stopped, Supervisor

# Stands in for a worker still starting: it says when its stop handler is in place, then waits for SIGUSR1.
WORKER = """
import pathlib, signal, sys, time
folder = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGUSR1, lambda *_: ((folder / "asked").write_text("stop"), sys.exit(0)))
(folder / "handler").write_text("ready")
time.sleep(60)
"""


def _wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


@pytest.fixture
def starting_worker(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)])
    try:
        _wait_for(tmp_path / "handler")
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_an_elastic_node_signalled_while_its_workers_start_asks_them_to_stop_once_ready(tmp_path, starting_worker):
    supervisor = Supervisor(30, clean=True, status_dir=tmp_path, shared_world=True)
    supervisor._on_signal(signal.SIGTERM, None)  # no status yet: the worker is starting
    assert starting_worker.poll() is None and starting_worker.pid in supervisor._pending
    (tmp_path / "status.rank1.json").write_text(json.dumps({"pid": starting_worker.pid, "batch": None}))
    supervisor._tell_ready()  # its watchdog runs: now it is asked, and the job stops at one batch
    assert starting_worker.wait(timeout=30) == 0
    assert (tmp_path / "asked").read_text() == "stop"


@pytest.mark.timeout(60)
def test_an_elastic_node_signalled_before_its_workers_are_forked_asks_them_once_they_start(tmp_path, monkeypatch):
    """Seen in CI: the signal came after the nodes met for a world and before this node forked its workers
    (the others' were starting). Stopped at once, it made the other nodes' workers fail as on a lost node."""
    forked: list[int] = []
    monkeypatch.setattr(supervise, "children", lambda pid=None: list(forked))
    in_world = threading.Event()
    in_world.set()
    supervisor = Supervisor(30, clean=True, status_dir=tmp_path, shared_world=True, in_world=in_world.is_set)
    supervisor._on_signal(signal.SIGTERM, None)  # no worker yet, and no exception: it waits for them
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)])
    try:
        forked.append(proc.pid)
        _wait_for(tmp_path / "handler")
        supervisor._await_workers()
        assert supervisor.had_workers
        (tmp_path / "status.rank0.json").write_text(json.dumps({"pid": proc.pid, "batch": None}))
        supervisor._tell_ready()
        assert proc.wait(timeout=30) == 0 and (tmp_path / "asked").read_text() == "stop"
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)
    supervisor._await_workers()  # a worker told once is not told again
    assert not supervisor._pending


def test_an_elastic_node_signalled_while_it_meets_the_others_stops_at_once(monkeypatch):
    """No world to stop cleanly: a signal while the node waits in the rendezvous stops it now, and one that
    waited for its workers stops once its agent goes back to meet the others instead."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    monkeypatch.setattr(supervise, "children", lambda pid=None: [])
    in_world = threading.Event()
    meeting = Supervisor(30, clean=True, shared_world=True, in_world=in_world.is_set)
    with pytest.raises(SignalException):
        meeting._on_signal(signal.SIGINT, None)
    assert not meeting.had_workers  # its stop line says so
    in_world.set()
    supervisor = Supervisor(30, clean=True, shared_world=True, in_world=in_world.is_set)
    supervisor._on_signal(signal.SIGINT, None)
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(supervise.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    in_world.clear()
    supervisor._await_workers()
    assert sent == [(os.getpid(), signal.SIGINT)] and not supervisor._awaiting


def test_a_signalled_node_of_several_never_reads_as_finished(tmp_path):
    """The stop line of an elastic node that left uncleanly, and of one whose run's summary another node
    wrote: 130/143 with a line, never exit 0; an earlier world's stop record is not this stop's batch."""
    from types import SimpleNamespace

    from dtrain.engine.stopping import write_stopped
    from dtrain.launcher.resume import stop_line

    logs = tmp_path / "r" / "logs"
    logs.mkdir(parents=True)
    write_stopped(logs, 280)  # the stop for the join, before this node's signal
    (tmp_path / "r" / "summary.json").write_text("{}")
    plan = SimpleNamespace(run_dir=tmp_path / "r", nodes=object(),
                           config=SimpleNamespace(checkpoint_storage=SimpleNamespace(path="checkpoints")))
    line = stop_line(plan, Stopped(signal.SIGINT, left=True, signalled_at=time.time() + 1), time.time() - 60)
    assert line is not None and line.startswith("dtrain: this node left the elastic job (SIGINT, its workers "
                                                "stopped before they could agree on a batch)"), line
    line = stop_line(plan, Stopped(signal.SIGINT, left=True, signalled_at=time.time() + 1, no_workers=True),
                     time.time() - 60)
    assert line is not None and line.startswith("dtrain: this node left the elastic job (SIGINT, while it met the "
                                                "other nodes: none of its workers had started)"), line
    line = stop_line(plan, Stopped(signal.SIGTERM, signalled_at=time.time() + 1), time.time() - 60)
    assert line is not None and "batch 280" not in line, line
    assert Stopped(signal.SIGTERM).exit_code == 143


def _agent(tmp_path: Path, nodes: list[str]):
    """An elastic agent with only what its membership steps read (no torch agent behind it)."""
    from types import SimpleNamespace

    from dtrain.launcher.elastic import ElasticAgent, ElasticSetup

    agent = ElasticAgent.__new__(ElasticAgent)
    agent.setup = ElasticSetup(run_dir=tmp_path, logs=tmp_path / "logs", ckpt_root=tmp_path / "checkpoints",
                               node=nodes[0], min_nodes=1, is_host=True, late=False, grace_seconds=30,
                               signalled=lambda: None)
    agent.recorder = SimpleNamespace(poll=lambda: None)
    agent.nodes, agent._previous, agent._world_started, agent._usual_settings = nodes, [], time.time() - 60, None
    return agent


def test_a_node_signalled_as_it_came_to_join_does_not_count_against_the_world_it_never_joined(tmp_path):
    """Found by signalling a joining node at various moments: its leaving note made the first node, stopped
    for that join, count it out of its own one-node world (0 remain, below --nnodes's minimum 1) and stop
    the job. Only this world's nodes count."""
    from types import SimpleNamespace

    from dtrain.launcher import membership

    agent = _agent(tmp_path, ["a"])
    restarts: list[object] = []
    agent._restart = restarts.append
    membership.note_leaving(tmp_path / "logs", "b", hosts_store=False)  # b, signalled before it was in a world
    group = SimpleNamespace(group_world_size=1, spec=SimpleNamespace(rdzv_handler=None))
    agent._continue_after_stop(group)  # no JobStopped: the job meets again, b or not
    assert restarts == [group] and membership.pending_event(tmp_path / "logs") is None
    agent.nodes = ["a", "b"]  # b in this world: its leave is noted, and counted
    agent._continue_after_stop(SimpleNamespace(group_world_size=2, spec=group.spec))
    assert membership.pending_event(tmp_path / "logs")["cause"] == "leave" and len(restarts) == 2


def test_a_round_whose_node_went_away_before_starting_its_workers_is_met_again(tmp_path, monkeypatch):
    """A node signalled just as the round completed never tells the others how many workers it starts: torch
    waits for that (60 s), then fails the agents. They meet again instead; the world is marked met only
    once its round is complete."""
    from types import SimpleNamespace

    from torch.distributed import DistStoreError
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from dtrain.launcher.elastic import _marking

    agent = _agent(tmp_path, ["a"])
    store: dict[str, bytes] = {}
    group = SimpleNamespace(group_rank=0, group_world_size=1, spec=SimpleNamespace(rdzv_handler=None),
                            store=SimpleNamespace(set=lambda k, v: store.__setitem__(k, v.encode()),
                                                  get=lambda k: store[k]))
    tries: list[bool] = []

    def torch_rendezvous(self, worker_group):
        tries.append(agent.setup.in_world.is_set())
        _marking(lambda: None, agent.setup.in_world)()  # the round completes: the world is met
        if len(tries) == 1:
            raise DistStoreError("wait timeout after 60000ms, keys: .../torchelastic/role_info/1")

    monkeypatch.setattr(LocalElasticAgent, "_rendezvous", torch_rendezvous)
    agent._rendezvous(group)
    assert len(tries) == 2 and agent.setup.in_world.is_set() and agent.nodes == ["a"]


def test_a_change_is_timed_to_its_first_step_even_when_its_status_is_read_steps_later(tmp_path):
    """A worker says when its first step ended; the record takes that, not the time the launcher happened to
    read a status published twice a second (ten short steps later here)."""
    from dtrain.engine.watchdog import RankStatus
    from dtrain.launcher.membership import Change, ChangeRecorder

    status = RankStatus()
    status.enter("data", 40)
    status.enter("forward")
    assert status.first_step_end is None
    status.enter("data", 41)
    ended = status.first_step_end
    assert ended is not None
    status.enter("data", 42)
    assert status.first_step_end == ended  # the first step's end only

    logs = tmp_path / "logs"
    logs.mkdir()
    published = {"rank": 0, "host": "h", "pid": os.getpid(), "batch": 51, "phase": "forward", "since": ended + 9,
                 "time": ended + 9.5, "gpu": False, "first_step_end": ended}
    (logs / "status.rank0.json").write_text(json.dumps(published))
    recorder = ChangeRecorder(tmp_path, logs, tmp_path / "checkpoints")
    recorder.current = Change({"cause": "join", "node": "b", "time": ended - 2.0}, 40, 1, 2, os.getpid(), {})
    record = recorder.poll()
    assert record is not None and record["seconds"] == 2.0 and record["first_step_time"] == ended


def test_a_join_whose_node_dropped_out_of_the_round_is_recorded_when_it_gets_in(tmp_path):
    """A node that joins, then misses the round (the others meet again without it, at the same size), is still
    joining: the world it gets into is the change recorded, not lost because the first round changed nothing."""
    from dtrain.launcher import membership

    logs, ckpts = tmp_path / "logs", tmp_path / "checkpoints"
    (ckpts / "182").mkdir(parents=True)
    (ckpts / "182" / "metadata.json").write_text(json.dumps({"world_size": 1, "batches": 182}))
    (ckpts / "latest").write_text("182")
    assert membership.note_event(logs, "join", "b")
    recorder = membership.ChangeRecorder(tmp_path, logs, ckpts)
    recorder.started(0, 1, os.getpid(), [], ["a"])  # the round without b: nothing to record yet
    assert recorder.current is None and membership.pending_event(logs)["node"] == "b"
    recorder.started(0, 2, os.getpid(), [], ["a", "b"])  # b gets in
    change = recorder.current
    assert change is not None and (change.cause["cause"], change.old_world, change.new_world) == ("join", 1, 2)
    # A joining node that was in the world from the start changes nothing, and its event is spent.
    recorder.started(0, 1, os.getpid(), [], ["b"])
    assert recorder.current is None and membership.pending_event(logs) is None
