"""Several machines: bad input, then real multi-node runs on network-namespace test hosts (root only),
and dtrain inside torchrun's workers.

Namespace tests use scripts/testhosts.py: every process is started in its own process group, killed
when time is up, and the namespaces (with their veths) are deleted in the fixture's teardown.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import PROBED, ROOT, cli_in_process, final_weights, free_port, tiny_config

sys.path.insert(0, str(ROOT / "scripts"))
import testhosts

from dtrain import cli
from dtrain.profiling.record import load_profile

NO_NAMESPACES = testhosts.unavailable_reason()
needs_namespaces = pytest.mark.skipif(NO_NAMESPACES is not None, reason=f"test hosts unavailable: {NO_NAMESPACES}")



def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def reference(reference_runs):
    """The tiny trial on 2 slots of one machine: what every multi-node variant must reproduce."""
    return reference_runs.weights(2)


# ------------------------------------------------------------------------------------------- bad input


def _one_line_error(capsys, argv, fragment, code=2):
    assert cli.main(argv) == code
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("dtrain: error: ") and fragment in err[0], err
    return err[0]


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:29500"],
     "--node-rank 2 is out of range for --nnodes 2: valid node ranks are 0 to 1"),
    (["--nnodes", "2", "--node-rank", "-1", "--master", "127.0.0.1:29500"], "out of range"),
    (["--nnodes", "2", "--node-rank", "0", "--master", "nohost"], "--master 'nohost': expected HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "0", "--master", "h:99999"], "port '99999' is not a number from 1 to 65535"),
    (["--nnodes", "2", "--node-rank", "0", "--master", ":29500"], "expected HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "1", "--master", "no-such-host.invalid:29500"], "does not resolve"),
    (["--nnodes", "two", "--node-rank", "0", "--master", "127.0.0.1:1"], "expected a node count N"),
    (["--nnodes", "1:2", "--node-rank", "0", "--master", "127.0.0.1:1"], "an elastic range needs --rdzv-backend c10d"),
    (["--nnodes", "2", "--master", "127.0.0.1:1"], "needs --node-rank (0 to 1)"),
    (["--nnodes", "2", "--node-rank", "0"], "needs --master HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "0", "--master", "127.0.0.1:1", "--slots", "3"],
     "resources.slots_per_trial 3 does not divide across 2 nodes"),
])
def test_bad_multinode_input(tmp_path, capsys, monkeypatch, extra, fragment):
    real = socket.getaddrinfo

    def no_dns(host, *args, **kwargs):  # an unknown name fails here instead of asking a DNS server
        if host == "no-such-host.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    cfg = tiny_config(tmp_path, **{"resources.join_timeout_seconds": 2})
    _one_line_error(capsys, ["run", str(cfg), "--run-dir", str(tmp_path / "r"), *extra], fragment)
    assert not (tmp_path / "r").exists()  # no run directory, no workers: nothing started


def test_interface_that_does_not_exist(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DTRAIN_NETWORK_INTERFACE", "nosuch0")
    cfg = tiny_config(tmp_path)
    line = _one_line_error(capsys, ["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--nnodes", "2",
                                    "--node-rank", "1", "--master", "127.0.0.1:29500"],
                           "network interface 'nosuch0' (from DTRAIN_NETWORK_INTERFACE) does not exist on host")
    assert "its interfaces: lo (127.0.0.1/8" in line
    monkeypatch.delenv("DTRAIN_NETWORK_INTERFACE")
    cfg = tiny_config(tmp_path, **{"resources.network_interface": "nosuch1"})
    _one_line_error(capsys, ["run", str(cfg), "--nnodes", "2", "--node-rank", "1", "--master", "127.0.0.1:29500"],
                    "'nosuch1' (from resources.network_interface) does not exist")
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------------ test hosts


def _node_cmd(cfg: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dtrain.cli", "run", str(cfg), "--run-dir", str(run_dir), "--quiet", *extra]


def _run_on_hosts(hosts: testhosts.TestHosts, jobs: list[tuple[int, list[str], dict]], timeout: float) -> list:
    """Start every (host, argv, env) at once; wait for all with one deadline; kill all on timeout."""
    env0 = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [hosts.popen(i, argv, cwd=ROOT, env={**env0, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True) for i, argv, env in jobs]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        hosts.destroy()  # kills every process group and everything left inside the namespaces
        said = [(proc.returncode, *proc.communicate()) for proc in procs[len(results):]]
        raise AssertionError(f"nodes did not finish within {timeout}s: {results + said}") from None
    return results


@pytest.fixture
def two_hosts():
    # Different interface names on the two hosts: only the subnet says they are the same network. Host 1
    # also has a second interface, x0, on a network that reaches nothing.
    with testhosts.TestHosts(2, ifnames=["eth0", "ens5"], extra_veth={1: ("x0", "10.213.1.2/24")},
                             pin_cpus=True) as hosts:
        yield hosts


@pytest.mark.slow
@needs_namespaces
def test_two_hosts_train_like_two_local_slots(tmp_path, two_hosts, reference):
    cfg = tiny_config(tmp_path, **PROBED, **{"resources.join_timeout_seconds": 30})
    run_dir = tmp_path / "r"
    master = f"{two_hosts.hostname(0)}:29500"
    results = _run_on_hosts(two_hosts, [
        (i, _node_cmd(cfg, run_dir, "--nnodes", "2", "--node-rank", str(i), "--master", master), {})
        for i in range(2)], timeout=90)
    for r in results:
        assert r.returncode == 0, r.stderr
    # Subnet match: each host uses its own interface name on the common 10.213.0.0/24.
    assert "network interface eth0" in results[0].stdout and "subnet match on 10.213.0.0/24" in results[0].stdout
    assert "network interface ens5" in results[1].stdout
    assert "dtrain: done" in results[0].stdout and "dtrain: done" not in results[1].stdout  # one summary per job
    _assert_same_weights(reference, final_weights(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["slots"] == 2 and summary["batches"] == 24
    # The end-of-run probes across the two hosts: the all-reduce on their link, each rank's batch probe.
    profile = load_profile(run_dir / "profile.json")
    assert profile.comm_probe is not None and profile.comm_probe.world == 2
    assert profile.batch_scaling is not None
    assert (run_dir / "logs" / "rank1.log").exists() and (run_dir / "logs" / "agent" / "node1").is_dir()
    assert not list(run_dir.glob(".join-*"))


def test_missing_node_fails_after_join_timeout_naming_it(tmp_path):
    """Node 0 alone, its launcher in this process (a node that never joins needs no host of its own)."""
    cfg = tiny_config(tmp_path, **{"resources.join_timeout_seconds": 2})
    start = time.monotonic()
    r = cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet", "--nnodes", "2", "--node-rank",
                       "0", "--master", f"127.0.0.1:{free_port()}")
    assert r.code == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtrain: error: node 1 of 2 never joined the rendezvous"), lines
    assert "within 2s (resources.join_timeout_seconds)" in lines[0] and "--node-rank 1" in lines[0]
    assert time.monotonic() - start < 30
    assert not (tmp_path / "r").exists()  # the run directory is made only once every node is there


@pytest.mark.slow
@needs_namespaces
def test_unreachable_master_and_wrong_interface_fail_fast(tmp_path, two_hosts):
    cfg = tiny_config(tmp_path, **{"resources.join_timeout_seconds": 20})
    node1 = ["--nnodes", "2", "--node-rank", "1"]
    results = _run_on_hosts(two_hosts, [
        # 10.213.99.1 is outside the test subnet: no route inside the namespace, nothing is sent.
        (1, _node_cmd(cfg, tmp_path / "a", *node1, "--master", "10.213.99.1:29500"), {}),
        (1, _node_cmd(cfg, tmp_path / "b", *node1, "--master", f"{two_hosts.hostname(0)}:29500"),
         {"DTRAIN_NETWORK_INTERFACE": "x0"}),
        # An interface the host does not have: test_interface_that_does_not_exist, in process.
    ], timeout=60)
    errors = []
    for r in results:
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dtrain: error: "), lines
        errors.append(lines[0])
    assert "has no route to the master 10.213.99.1:29500" in errors[0] and "Network is unreachable" in errors[0]
    assert ("node 1 on host ") in errors[1] and ("interface x0 (10.213.1.2/24; set by DTRAIN_NETWORK_INTERFACE) does "
            "not reach the master h0:29500 (10.213.0.1): tried the route lookup to 10.213.0.1: it leaves through "
            "ens5") in errors[1]


# --------------------------------------------------------------------------------------------- torchrun


@pytest.mark.slow
def test_inside_torchrun_uses_its_ranks(tmp_path, reference):
    """torchrun started the workers: dtrain trains in place, with torchrun's ranks, no agent of its own."""
    cfg = tiny_config(tmp_path, **{"resources.slots_per_trial": 1})  # torchrun's 2 workers win, with a warning
    run_dir = tmp_path / "r"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "dtrain.cli", "run",
                             str(cfg), "--run-dir", str(run_dir), "--quiet"], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    assert proc.returncode == 0, err
    assert out.count("dtrain: done") == 1 and "on 2 slot(s)" in out, out
    assert "torchrun started 2 workers: resources.slots_per_trial 1 is replaced by 2" in err
    _assert_same_weights(reference, final_weights(run_dir))
    assert not (run_dir / "logs" / "agent").exists()  # no dtrain agent: torchrun's workers trained in place
