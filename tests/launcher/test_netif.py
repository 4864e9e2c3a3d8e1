"""Network interface detection: listing, the common-interface rule, overrides, the reachability probe."""

from __future__ import annotations

import socket

import pytest

from dtrain.errors import UserError
from dtrain.launcher import netif
from dtrain.launcher.netif import Interface, NodeInterfaces, choose_common


def _node(label, *ifaces, route=None):
    return NodeInterfaces(label, tuple(Interface(n, tuple(a), s) for n, a, s in ifaces), route)


def test_subnet_match_when_names_differ():
    nodes = [_node("n0", ("eth0", ["10.1.0.1/24"], None), ("docker-ish", ["172.17.0.1/16"], None)),
             _node("n1", ("ens5", ["10.1.0.2/24"], None))]
    choice = choose_common(nodes)
    assert choice.names == ("eth0", "ens5")
    assert choice.network == "10.1.0.0/24" and "subnet match" in choice.reason


def test_fastest_known_link_wins_and_the_slowest_node_counts():
    nodes = [_node("n0", ("eth0", ["10.1.0.1/24"], 1000), ("ib0", ["10.2.0.1/24"], 100000)),
             _node("n1", ("eth0", ["10.1.0.2/24"], 1000), ("ib0", ["10.2.0.2/24"], 40000))]
    choice = choose_common(nodes)
    assert choice.names == ("ib0", "ib0") and "fastest known link (40000 Mbit/s)" in choice.reason
    # A speed unknown on one node: that candidate has no known speed, the other one wins.
    nodes[1] = _node("n1", ("eth0", ["10.1.0.2/24"], 1000), ("ib0", ["10.2.0.2/24"], None))
    assert choose_common(nodes).names == ("eth0", "eth0")


def test_without_speeds_the_route_to_the_master_decides():
    nodes = [_node("n0", ("eth0", ["10.1.0.1/24"], None), ("eth1", ["10.2.0.1/24"], None), route="eth1"),
             _node("n1", ("eth0", ["10.1.0.2/24"], None), ("eth1", ["10.2.0.2/24"], None), route="eth1")]
    choice = choose_common(nodes)
    assert choice.names == ("eth1", "eth1") and choice.reason.startswith("routes to the master")


def test_name_match_across_different_subnets_and_no_common_interface():
    nodes = [_node("n0", ("eth0", ["10.1.0.1/24"], None)), _node("n1", ("eth0", ["10.9.0.2/24"], None))]
    choice = choose_common(nodes)
    assert choice.names == ("eth0", "eth0") and "name match" in choice.reason
    nodes = [_node("n0", ("eth0", ["10.1.0.1/24"], None)), _node("n1", ("ens5", ["10.9.0.2/24"], None))]
    with pytest.raises(UserError, match=r"share no network interface .*n0: eth0 \(10.1.0.1/24\); n1: ens5"):
        choose_common(nodes)


@pytest.mark.parametrize(("name", "excluded"), [
    ("lo", True), ("docker0", True), ("br-0123456789ab", True), ("virbr0", True), ("cni0", True),
    ("veth1a2b3c4", True), ("flannel.1", True), ("cali12ab34cd", True),
    ("eth0", False), ("ens5", False), ("ib0", False), ("bond0", False), ("br0", False),
])
def test_loopback_and_container_bridges_are_excluded(name, excluded):
    assert netif.excluded(name) is excluded


def test_this_hosts_interfaces_and_route():
    every = netif.list_interfaces(include_excluded=True)
    assert any(i.name == "lo" and "127.0.0.1/8" in i.addresses for i in every)
    usable = netif.list_interfaces()
    assert all(i.name != "lo" and i.addresses for i in usable)
    assert netif.route_interface("127.0.0.1") == "lo"  # the UDP route lookup sends nothing


def test_override_precedence(monkeypatch):
    env = {"DTRAIN_NETWORK_INTERFACE": "a0", "GLOO_SOCKET_IFNAME": "c0"}
    assert netif.override("b0", env) == ("a0", "DTRAIN_NETWORK_INTERFACE")
    assert netif.override("b0", {"GLOO_SOCKET_IFNAME": "c0"}) == ("b0", "resources.network_interface")
    assert netif.override(None, {"GLOO_SOCKET_IFNAME": "c0"}) == ("c0", "GLOO_SOCKET_IFNAME")
    assert netif.override(None, {}) is None
    with pytest.raises(UserError, match=r"'nosuch0' .*does not exist on host h1 .*its interfaces: lo"):
        netif.check_override("nosuch0", "DTRAIN_NETWORK_INTERFACE", "h1")
    assert netif.check_override("lo", "x", "h1").ips == ["127.0.0.1"]


def test_probe_and_wait_listening_on_loopback():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert netif.probe("lo", "127.0.0.1", "127.0.0.1", port, timeout=2) is None
        assert netif.wait_listening("lo", "127.0.0.1", "127.0.0.1", port, deadline=0) is None
    # Nothing listens any more: a refusal still proves the path (probe), but is no store (wait).
    assert netif.probe("lo", "127.0.0.1", "127.0.0.1", port, timeout=2) is None
    problem = netif.wait_listening("lo", "127.0.0.1", "127.0.0.1", port, deadline=0)
    assert problem is not None and problem.startswith("connection refused")
