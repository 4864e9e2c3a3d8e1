"""``dtrain launch`` on several machines: its node options checked as ``dtrain run``'s are (in this process),
then a plain DDP script (tests/scripts/ddp_ranks.py, no dtrain import) run across two network-namespace test
hosts (scripts/testhosts.py, root only), as tests/launcher/test_multinode.py runs ``dtrain run``.

Every process starts in its own process group; at the deadline the namespaces are torn down with everything
left in them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, cli_in_process, free_port

sys.path.insert(0, str(ROOT / "scripts"))
import testhosts

SCRIPT = ROOT / "tests" / "scripts" / "ddp_ranks.py"
NO_NAMESPACES = testhosts.unavailable_reason()
needs_namespaces = pytest.mark.skipif(NO_NAMESPACES is not None, reason=f"test hosts unavailable: {NO_NAMESPACES}")


def _script_module():
    spec = importlib.util.spec_from_file_location("ddp_ranks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference_weights() -> list[float]:
    """The script's training in one process on whole batches: what every world of ranks must reach."""
    script = _script_module()
    net = script.model()
    script.train(net, 0, 1)
    return [float(v) for p in net.parameters() for v in p.detach().flatten()]


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--slots", "3", "--nnodes", "2", "--node-rank", "0", "--master", "127.0.0.1:29500"],
     "--slots 3 does not divide across 2 nodes (--nnodes 2): every node runs the same number of slots; use a "
     "multiple of 2 (e.g. --slots 2)"),
    (["--slots", "2", "--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:29500"],
     "--node-rank 2 is out of range for --nnodes 2: valid node ranks are 0 to 1"),
    (["--slots", "2", "--nnodes", "2", "--master", "127.0.0.1:29500"], "needs --node-rank (0 to 1)"),
    (["--slots", "2", "--nnodes", "2", "--node-rank", "0"], "needs --master HOST:PORT"),
    (["--slots", "2", "--nnodes", "2", "--node-rank", "0", "--master", "nohost"],
     "--master 'nohost': expected HOST:PORT"),
    (["--slots", "2", "--nnodes", "two", "--node-rank", "0", "--master", "127.0.0.1:1"], "expected a node count N"),
    (["--slots", "2", "--nnodes", "1:2", "--master", "127.0.0.1:1"], "an elastic range needs --rdzv-backend c10d"),
    (["--slots", "2", "--nnodes", "2:1", "--rdzv-backend", "c10d", "--master", "127.0.0.1:1"],
     "need 1 <= MIN <= MAX, got 2:1"),
    (["--slots", "2", "--nnodes", "2", "--rdzv-backend", "etcd", "--master", "127.0.0.1:1"],
     "argument --rdzv-backend: invalid choice: 'etcd'"),
    (["--slots", "2", "--node-rank", "1"], "--node-rank 1 is out of range for --nnodes 1 (valid: 0)"),
])
def test_bad_node_options_are_one_line_before_anything_starts(tmp_path, extra, fragment):
    out = tmp_path / "out"
    out.mkdir()
    result = cli_in_process("launch", *extra, str(SCRIPT), "--out", str(out))
    assert result.code == 2, (result.code, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dtrain: error: ") and fragment in lines[0], lines
    assert list(out.iterdir()) == []  # no worker ran the script


def test_help_says_what_slots_and_an_elastic_range_mean():
    result = cli_in_process("launch", "--help")
    assert result.code == 0
    text = " ".join(result.stdout.split())
    assert "slots of the whole job (with --nnodes: split evenly across the nodes)" in text
    assert "--slots is split across them" in text
    assert "restarts every worker, as under torchrun, so the script must resume from its own checkpoint" in text
    assert "--node-rank" in text and "--master" in text and "--rdzv-id" in text


# ------------------------------------------------------------------------------------------ test hosts


def _launch(out: Path, node: int, *node_args: str, script_args: tuple[str, ...] = ()) -> list[str]:
    """``dtrain launch`` of the script on 2 slots in all; each node profiles into a run directory of its own
    (``--run-dir``, beside ``out``: never under the repository's runs/)."""
    return [sys.executable, "-m", "dtrain.cli", "launch", "--slots", "2", "--run-dir", str(out.parent / f"run{node}"),
            *node_args, str(SCRIPT), "--out", str(out), *script_args]


def _start(hosts: testhosts.TestHosts, i: int, argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return hosts.popen(i, argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_all(hosts: testhosts.TestHosts, procs: list[subprocess.Popen], deadline: float) -> list:
    """Every process's (code, stdout, stderr) by ``deadline``; past it, every process on the hosts is killed."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        hosts.destroy()  # kills every process group and everything left inside the namespaces
        said = [(proc.returncode, *proc.communicate()) for proc in procs[len(results):]]
        raise AssertionError(f"the nodes did not finish in time: {results + said}") from None
    return results


def _records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def _assert_one_world_of_two(out: Path) -> list[dict]:
    records = _records(out, 2)
    assert sorted(path.name for path in out.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    assert [(r["rank"], r["world_size"]) for r in records] == [(0, 2), (1, 2)]
    assert {r["group_rank"] for r in records} == {0, 1}  # one rank on each node
    reference = torch.tensor(_reference_weights())
    for record in records:  # every rank trained to the weights of whole batches in one process
        torch.testing.assert_close(torch.tensor(record["weights"]), reference, rtol=1e-5, atol=1e-6)
    assert records[0]["weights"] == records[1]["weights"]
    return records


@pytest.fixture
def two_hosts():
    # Different interface names: only the subnet says the hosts share a network (as for dtrain run's tests).
    with testhosts.TestHosts(2, ifnames=["eth0", "ens5"], pin_cpus=True) as hosts:
        yield hosts


@pytest.mark.slow
def test_nodes_running_other_script_arguments_are_refused_on_both(tmp_path):
    """Node 1 a process of its own, node 0's launcher in this process, on this host: the arguments are compared
    at the rendezvous, which needs no second host."""
    out = tmp_path / "out"
    out.mkdir()
    node_args = ["--nnodes", "2", "--master", f"127.0.0.1:{free_port()}", "--node-rank"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    other = subprocess.Popen(_launch(out, 1, *node_args, "1", script_args=("--wait", "5")), cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        here = cli_in_process(*_launch(out, 0, *node_args, "0")[3:])  # what follows `python -m dtrain.cli`
        said = other.communicate(timeout=60)
        results = [(here.code, here.stdout, here.stderr), (other.returncode, *said)]
    finally:
        if other.poll() is None:
            os.killpg(other.pid, 9)
            other.communicate()
    for code, _, err in results:
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("dtrain: error: "), err
        assert "has a different script than" in lines[0] and "args: [" in lines[0], lines[0]
        assert "start every node with the same script (the same file), arguments, --slots" in lines[0]
    assert list(out.iterdir()) == []  # refused before any worker started
    assert not (tmp_path / "run0").exists() and not (tmp_path / "run1").exists()  # and before any run directory


@pytest.mark.slow
@needs_namespaces
def test_elastic_range_restarts_the_script_when_a_node_joins(tmp_path, two_hosts):
    """--nnodes 1:2: node 0 starts alone (a world of 1, where the script waits); node 1 joins; torch's agent
    restarts every worker and the script runs again in a world of 2 (no dtrain checkpoint in between), one
    rank on each host, each host on its own interface. (Two hosts meeting with --node-rank: dtrain run's, in
    test_multinode.py; dtrain launch's nodes meet the same way, and the test above refuses them on one host.)"""
    out = tmp_path / "out"
    out.mkdir()
    node_args = ("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-id", "job9", "--master",
                 f"{two_hosts.hosts[0].address}:29400")
    deadline = time.monotonic() + 90
    first = _start(two_hosts, 0, _launch(out, 0, *node_args, script_args=("--want-world", "2")))
    while not (out / "waiting-rank0.json").exists():  # node 0's script runs, alone
        if first.poll() is not None or time.monotonic() > deadline:
            two_hosts.destroy()
            raise AssertionError(f"node 0's script never started alone: {first.communicate()}")
        time.sleep(0.1)
    assert json.loads((out / "waiting-rank0.json").read_text()) == {"rank": 0, "world_size": 1}
    second = _start(two_hosts, 1, _launch(out, 1, *node_args, script_args=("--want-world", "2")))
    results = _wait_all(two_hosts, [first, second], deadline)
    assert [code for code, _, _ in results] == [0, 0], results
    # No node closes the rendezvous after the host's store went away (torch's C++ trace, after a success).
    assert not any("Traceback" in err or "TCPStore" in err for _, _, err in results), results
    assert "is elastic: when a node joins or leaves, every node's workers restart" in results[0][1]
    assert "the script must resume from its own checkpoint" in results[1][1]
    # What dtrain says before the rendezvous: each host on its own interface of the common subnet.
    assert "dtrain: this node (host " in results[0][1] and "network interface eth0 (" in results[0][1]
    assert "subnet match on 10.213.0.0/24" in results[0][1]
    assert "network interface ens5" in results[1][1]
    _assert_one_world_of_two(out)
