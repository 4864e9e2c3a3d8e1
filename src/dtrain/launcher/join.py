"""Bringing several machines together before torch's rendezvous: a short, typed protocol over a TCPStore.

Every node runs ``dtrain run``; torch's rendezvous (static: node ranks given; c10d: assigned, for elastic
jobs) then joins their agents. Before it, :func:`join` holds a pre-rendezvous on a ``TCPStore`` at the
same HOST:PORT (torch's rendezvous reuses that very store server):

1. every node publishes a :class:`NodeReport` (interfaces, config digest, slots);
2. the node hosting the store waits for all of them within the join timeout (naming missing nodes),
   checks that configs and slot counts agree, picks the network interface (:mod:`dtrain.launcher.netif`), makes
   the run directory and publishes a :class:`Decision`;
3. every other node checks the run directory is visible (shared storage) and that its interface
   reaches the host, and answers with an :class:`Answer` (``ack``); the host answers all with ``go``.

Only then does any worker start, so a bad setup costs one line on every node and no half-started job.
Every store key is named in :class:`Keys`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as tdist

from dtrain.errors import UserError
from dtrain.launcher import netif
from dtrain.launcher.rendezvous import (
    Answer,
    Decision,
    JoinError,
    Keys,
    NodeLaunch,
    NodeReport,
    Rendezvous,
    config_digest,
    first_difference,
    get_message,
    linger,
    put_message,
    wait_key,
)

log = logging.getLogger("dtrain")
# On the store itself (no job's prefix): the rendezvous id of the job formed there.
RUNNING_JOB = "dtrain-join-running"
# Under the job's prefix: how many nodes' agents are done (:func:`leave_last`).
DONE = "done"


# ------------------------------------------------------------------------------------ the protocol


@dataclass
class _Node:
    """This node's side of the join, as it goes along."""

    rdzv: Rendezvous
    hostname: str
    master_ip: str
    loopback: bool
    is_host: bool
    me: str
    forced: tuple[str, str] | None = None
    forced_iface: Any = None
    src_name: str = "?"
    src_ip: str = ""

    @property
    def label(self) -> str:
        return f"{self.me} (host {self.hostname}, {self.src_ip})"


def join(rdzv: Rendezvous, config_dict: Mapping[str, Any], slots_per_node: int, iface_setting: str | None,
         host_prepare: Callable[[], dict], node_check: Callable[[dict], None],
         host_abort: Callable[[], None] = lambda: None, what: str = "experiment config",
         fix: str = "start every node with the same config file and --set/--slots options") -> tuple[NodeLaunch, dict]:
    """Meet the other nodes before torch's rendezvous; return how to launch and the host's run plan.

    ``config_dict`` must be the same on every node (compared by digest; ``what`` it is and how to ``fix`` a
    difference, for the message: a ``dtrain run`` config, a ``dtrain launch`` script). On the node hosting the
    store, ``host_prepare()`` makes the run directory once every node has joined and returns the plan
    (run dir, resume point) every node uses; elsewhere ``node_check(plan)`` verifies it (shared
    storage). ``host_abort()`` undoes ``host_prepare`` if a later check fails. Raises JoinError.
    """
    node = _this_node(rdzv)
    _route_to_master(node, iface_setting)
    deadline = time.monotonic() + rdzv.join_timeout
    server = _connect(node, deadline)
    store = tdist.PrefixStore(f"dtrain-join/{rdzv.rdzv_id}", server)
    report = NodeReport(
        label=node.label, hostname=node.hostname, ip=node.src_ip,
        interfaces=[i.to_json() for i in ([node.forced_iface] if node.forced_iface else netif.list_interfaces())],
        forced=node.forced[0] if node.forced else None, master_route=node.src_name, slots=slots_per_node,
        config=dict(config_dict), digest=config_digest(config_dict))
    key = _announce(store, rdzv, report)
    if node.is_host:
        decision = _host_decide(store, node, report, key, deadline, host_prepare, (what, fix))
        server.set(RUNNING_JOB, rdzv.rdzv_id)
    else:
        running = server.get(RUNNING_JOB).decode() if server.check([RUNNING_JOB]) else rdzv.rdzv_id
        if running != rdzv.rdzv_id:
            raise JoinError(f"{node.label}: the job at {rdzv.endpoint} is {running!r}, not {rdzv.rdzv_id!r}: only "
                            f"nodes of the same job join it; pass --rdzv-id {running} (and its config), or another "
                            "--master port for a job of your own")
        raw = wait_key(store, Keys.DECISION, deadline + 30)
        if raw is None:
            raise JoinError(f"{node.label} joined, but the node hosting {rdzv.endpoint} never answered; is it still "
                            "running? (see its output)")
        decision = get_message(raw, Decision)
        store.add(Keys.seen(Keys.DECISION), 1)
        if not decision.ok:
            raise JoinError(decision.message)
        if key not in decision.names:  # a running job: nobody checked this node's config against it
            _check_late(store, decision, report, (what, fix))

    # Settle this node's interface and check it reaches the host's address on that network.
    ifname = decision.names.get(key) or ("lo" if node.loopback else _late_interface(decision, report, node.label))
    iface = next((netif.Interface.from_json(i) for i in report.interfaces if i["name"] == ifname), None)
    local_ip = "127.0.0.1" if node.loopback else _address_on(iface, decision.network) if iface else node.src_ip
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    os.environ["NCCL_SOCKET_IFNAME"] = ifname
    if node.is_host:
        _host_go(store, rdzv, decision, key, host_abort)
    else:
        _node_confirm(store, node, decision, key, ifname, local_ip, node_check)
    launch = _node_launch(node, decision, key, ifname, local_ip, server)
    print(f"dtrain: {launch.label}: network interface {launch.ifname} ({launch.interface_reason})", flush=True)
    return launch, decision.plan


def _this_node(rdzv: Rendezvous) -> _Node:
    hostname = socket.gethostname()
    master_ip = netif.resolve_ipv4(rdzv.host)
    loopback = ipaddress.ip_address(master_ip).is_loopback
    mine = netif.local_ips()
    if rdzv.backend == "static":
        is_host = rdzv.node_rank == 0
        if is_host and not loopback and master_ip not in mine:
            raise JoinError(f"--node-rank 0 hosts the rendezvous, but the master {rdzv.endpoint} ({master_ip}) is "
                            f"not an address of this host {hostname} (its addresses: {', '.join(sorted(mine))}); "
                            "run node 0 on the master host, or pass --master with one of this host's addresses")
    else:
        is_host = loopback or master_ip in mine
    me = f"node {rdzv.node_rank}" if rdzv.node_rank is not None else "this node"
    return _Node(rdzv, hostname, master_ip, loopback, is_host, me)


def _route_to_master(node: _Node, iface_setting: str | None) -> None:
    """The interface this node would use on its own: forced, or the one its route to the master takes."""
    rdzv, master_ip = node.rdzv, node.master_ip
    node.forced = netif.override(iface_setting)
    if node.forced:
        node.forced_iface = netif.check_override(node.forced[0], node.forced[1], node.hostname)
    if node.loopback:
        node.src_name, node.src_ip = "lo", "127.0.0.1"
    elif node.forced_iface is not None:
        iface = node.forced_iface
        node.src_name, node.src_ip = iface.name, iface.ips[0]
        # A device-bound socket makes the kernel try any address as if on that link, so a wrong
        # interface would only show as a timeout: reject the plain mismatch at once.
        route = netif.route_interface(master_ip)
        if route != iface.name and not any(ipaddress.ip_address(master_ip) in n for n in iface.networks):
            addresses, setting = ", ".join(iface.addresses), node.forced[1]  # type: ignore[index]
            raise JoinError(f"{node.me} on host {node.hostname}: interface {iface.name} ({addresses}; set by "
                            f"{setting}) does not reach the master {rdzv.endpoint} ({master_ip}): tried the route "
                            f"lookup to {master_ip}: it leaves through {route or 'no interface (no route)'}, and "
                            f"{master_ip} is not on {iface.name}'s network; set {netif.ENV_OVERRIDE} to "
                            f"{route or 'an interface that reaches it'}, or remove the setting to auto-detect")
    else:
        try:
            node.src_ip = netif.route_source(master_ip)
        except OSError as exc:
            raise JoinError(f"{node.me} on host {node.hostname} has no route to the master {rdzv.endpoint} "
                            f"({master_ip}): {exc.strerror or exc}; pass a --master address this host can "
                            "reach") from None
        found = netif.interface_for_ip(node.src_ip, netif.list_interfaces(include_excluded=True))
        node.src_name = found.name if found else "?"


def _connect(node: _Node, deadline: float) -> Any:
    """The store server. The host serves it; the others first wait until it accepts a connection from
    the chosen interface (also the reachability check of a forced interface), so torch's C++ client
    never retries noisily."""
    rdzv = node.rdzv
    timeout = timedelta(seconds=max(1.0, rdzv.join_timeout))
    if node.is_host:
        try:
            return tdist.TCPStore(node.master_ip, rdzv.port, None, True, timeout, wait_for_workers=False,
                                  multi_tenant=True)
        except (RuntimeError, OSError) as exc:
            if rdzv.backend == "static":
                raise JoinError(f"{node.me} cannot serve the rendezvous on port {rdzv.port} of host {node.hostname}: "
                                f"{str(exc).splitlines()[0]}; choose a free port in --master HOST:PORT") from None
            # c10d with several nodes on the master's machine: another one serves already (torch's
            # c10d backend does the same fallback).
            node.is_host = False
    problem = netif.wait_listening(node.src_name, node.src_ip, node.master_ip, rdzv.port, deadline)
    if problem is not None:
        source = f" (from {node.forced[1]})" if node.forced else ""
        raise JoinError(f"{node.label} cannot reach the master {rdzv.endpoint} within {rdzv.join_timeout:g}s "
                        f"(resources.join_timeout_seconds): tried a TCP connect from {node.src_ip} on interface "
                        f"{node.src_name}{source} to {node.master_ip}:{rdzv.port}: {problem}; check that node 0 was "
                        f"started with the same --master, that the address is right and the port open"
                        + (f", or set {netif.ENV_OVERRIDE} to an interface that reaches it" if node.forced else ""))
    try:
        return tdist.TCPStore(node.master_ip, rdzv.port, None, False, timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise JoinError(f"{node.label} lost the master {rdzv.endpoint}: {str(exc).splitlines()[0]}") from None


def _announce(store: Any, rdzv: Rendezvous, report: NodeReport) -> str:
    """Publish this node's report; returns its key (static: node rank; c10d: arrival number)."""
    if rdzv.backend == "static":
        key = str(int(rdzv.node_rank or 0))
        if store.add(Keys.claim(key), 1) > 1:
            store.set(Keys.duplicate(key), report.label)
            raise JoinError(f"{report.label}: node rank {key} was already taken by another node; give every node "
                            f"its own --node-rank from 0 to {rdzv.max_nodes - 1}")
    else:
        key = str(store.add(Keys.ARRIVALS, 1) - 1)
    put_message(store, Keys.node(key), report)
    return key


def _gather_reports(store: Any, rdzv: Rendezvous, mine: NodeReport, key: str,
                    deadline: float) -> tuple[dict[str, NodeReport], str | None]:
    """On the host: every node's report, or what went wrong (a missing node, a duplicate rank)."""
    reports: dict[str, NodeReport] = {key: mine}
    expected = [str(r) for r in range(rdzv.max_nodes)] if rdzv.backend == "static" else None
    while True:
        if expected is not None:
            dups = [r for r in expected if store.check([Keys.duplicate(r)])]
            if dups:
                other = store.get(Keys.duplicate(dups[0])).decode()
                return reports, (f"two nodes were started with --node-rank {dups[0]} ({other} and another); give "
                                 f"every node its own --node-rank from 0 to {rdzv.max_nodes - 1}")
            keys = expected
        else:
            keys = [str(i) for i in range(int(store.add(Keys.ARRIVALS, 0)))]
        for k in keys:
            if k not in reports and store.check([Keys.node(k)]):
                reports[k] = get_message(store.get(Keys.node(k)), NodeReport)
        arrived = len(reports)
        if (expected is not None and arrived == len(expected)) or (expected is None and arrived >= rdzv.min_nodes):
            return reports, None
        if time.monotonic() >= deadline:
            return reports, _missing_message(rdzv, reports, expected)
        time.sleep(0.05)


def _missing_message(rdzv: Rendezvous, reports: dict[str, NodeReport], expected: list[str] | None) -> str:
    joined = ", ".join(r.label for _, r in sorted(reports.items()))
    if expected is not None:
        missing = [k for k in expected if k not in reports]
        return (f"node{'s' if len(missing) > 1 else ''} {', '.join(missing)} of {rdzv.max_nodes} never joined the "
                f"rendezvous at {rdzv.endpoint} within {rdzv.join_timeout:g}s (resources.join_timeout_seconds); "
                f"joined: {joined}; start the missing node with --node-rank {missing[0]} --master {rdzv.endpoint}, "
                "or check that it can reach that address")
    return (f"only {len(reports)} of {rdzv.min_nodes} nodes joined the c10d rendezvous {rdzv.rdzv_id!r} at "
            f"{rdzv.endpoint} within {rdzv.join_timeout:g}s (resources.join_timeout_seconds); joined: {joined}; "
            f"start the missing {rdzv.min_nodes - len(reports)} node(s) with the same --master and --rdzv-id")


def _host_decide(store: Any, node: _Node, mine: NodeReport, key: str, deadline: float,
                 host_prepare: Callable[[], dict], subject: tuple[str, str]) -> Decision:
    """On the store host: wait for every node, check them, choose the interface, make the run plan."""
    rdzv = node.rdzv
    reports, message = _gather_reports(store, rdzv, mine, key, deadline)
    keys = sorted(reports, key=int)
    ordered = [reports[k] for k in keys]
    choice = None
    message = message or _check_reports(ordered, mine, subject)
    if message is None:
        try:
            choice = _choose_names(ordered, node.loopback)
        except UserError as exc:
            message = str(exc)
    if message is not None or choice is None:
        _refuse(store, str(message), len(reports) - 1)
    host_ifname = choice.names[keys.index(key)]
    host_iface = None if node.loopback else next(netif.Interface.from_json(i) for i in mine.interfaces
                                                 if i["name"] == host_ifname)
    try:
        plan = host_prepare()
    except Exception as exc:  # bad input, or a resumed run that already finished: every node hears why
        _refuse(store, f"{node.label}: {exc}", len(reports) - 1, raise_as=exc)
    decision = Decision(
        ok=True, names=dict(zip(keys, choice.names, strict=True)), network=choice.network,
        reason=choice.reason, host_label=node.label, host_ifname=host_ifname,
        target_ip="127.0.0.1" if host_iface is None else _address_on(host_iface, choice.network),
        run_id=rdzv.rdzv_id if rdzv.backend == "c10d" else f"dtrain-{uuid.uuid4().hex[:8]}", plan=plan)
    put_message(store, Keys.DECISION, decision)
    log.info("network interface: %s (%s)", ", ".join(dict.fromkeys(decision.names.values())), decision.reason)
    return decision


def _refuse(store: Any, message: str, readers: int, raise_as: Exception | None = None) -> NoReturn:
    put_message(store, Keys.DECISION, Decision(ok=False, message=message))
    linger(store, Keys.DECISION, readers)
    if raise_as is not None:
        raise raise_as
    raise JoinError(message)


def _check_reports(reports: list[NodeReport], mine: NodeReport, subject: tuple[str, str]) -> str | None:
    what, fix = subject
    for other in reports:
        if other.digest != mine.digest:
            diff = first_difference(mine.config, other.config)
            return f"{other.label} has a different {what} than {mine.label} ({diff}); {fix}"
        if other.slots != mine.slots:
            return (f"{other.label} would run {other.slots} slot(s) but {mine.label} {mine.slots}; start every node "
                    "with the same --nnodes and --slots")
    return None


def _choose_names(reports: list[NodeReport], loopback: bool) -> netif.Choice:
    if loopback:  # every node on this very machine
        return netif.Choice(names=tuple("lo" for _ in reports), reason="master on loopback")
    nodes = [netif.NodeInterfaces(r.label, tuple(netif.Interface.from_json(i) for i in r.interfaces),
                                  r.master_route) for r in reports]
    return netif.choose_common(nodes)


def _node_confirm(store: Any, node: _Node, decision: Decision, key: str, ifname: str, local_ip: str,
                  node_check: Callable[[dict], None]) -> None:
    """A non-host node: check the plan and the path to the host, answer, wait for ``go``."""
    rdzv, problem = node.rdzv, None
    try:
        node_check(decision.plan)
    except UserError as exc:
        problem = f"{node.label}: {exc}"
    if problem is None and not node.loopback:
        probe = netif.probe(ifname, local_ip, decision.target_ip, rdzv.port, timeout=min(5.0, rdzv.join_timeout))
        if probe is not None:
            problem = (f"{node.label}: interface {ifname} ({local_ip}) does not reach the master host: tried a TCP "
                       f"connect from {local_ip} on {ifname} to {decision.target_ip}:{rdzv.port} "
                       f"({decision.host_label}'s address on {decision.host_ifname}): {probe}; set "
                       f"{netif.ENV_OVERRIDE} on this node to an interface that reaches it")
    put_message(store, Keys.ack(key), Answer(ok=problem is None, message=problem or ""))
    if problem is not None:
        raise JoinError(problem)
    raw = wait_key(store, Keys.GO, time.monotonic() + max(30.0, rdzv.join_timeout))
    go = get_message(raw, Answer) if raw is not None else Answer(False, f"{node.label}: the host never said go")
    if raw is not None:
        store.add(Keys.seen(Keys.GO), 1)
    if not go.ok:
        raise JoinError(go.message)


def _host_go(store: Any, rdzv: Rendezvous, decision: Decision, key: str, host_abort: Callable[[], None]) -> None:
    """The host: collect every node's ``ack``, then say ``go`` (or why not) to all."""
    waiting = [k for k in decision.names if k != key]
    deadline = time.monotonic() + max(30.0, rdzv.join_timeout)
    problems = []
    for k in waiting:
        raw = wait_key(store, Keys.ack(k), deadline)
        missing = Answer(False, f"node {k} never confirmed its network check")
        ack = get_message(raw, Answer) if raw is not None else missing
        if not ack.ok:
            problems.append(ack.message)
    put_message(store, Keys.GO, Answer(ok=not problems, message="; ".join(problems)))
    if problems:
        host_abort()
        linger(store, Keys.GO, len(waiting))
        raise JoinError("; ".join(problems))


def _node_launch(node: _Node, decision: Decision, key: str, ifname: str, local_ip: str, server: Any) -> NodeLaunch:
    rdzv = node.rdzv
    configs: dict[str, Any]
    if rdzv.backend == "static":
        configs = {"rank": rdzv.node_rank, "timeout": int(max(1, rdzv.join_timeout))}
    else:
        configs = {"join_timeout": int(max(1, rdzv.join_timeout)), "is_host": node.is_host,
                   "last_call_timeout": rdzv.last_call if rdzv.min_nodes < rdzv.max_nodes else 1}
    # c10d: the arrival number too, as two nodes may share a host name and address (containers, one machine).
    log_name = f"node{rdzv.node_rank}" if rdzv.node_rank is not None else f"{node.hostname}-{local_ip}-{key}"
    return NodeLaunch(
        min_nodes=rdzv.min_nodes, max_nodes=rdzv.max_nodes, rdzv_backend=rdzv.backend,
        rdzv_endpoint=f"{node.master_ip}:{rdzv.port}", rdzv_configs=configs, run_id=decision.run_id,
        local_addr=local_ip, log_name=log_name, ifname=ifname, is_host=node.is_host, label=node.label, store=server,
        interface_reason=decision.reason if key in decision.names else "joined late: the job's network",
        late=key not in decision.names)


def leave_last(nodes: NodeLaunch, seconds: float = 5.0) -> None:
    """After a c10d job under torch's own agent: every node's agent closes the rendezvous on its way out, in the
    store that the host's process serves. The other nodes say they are done; the host waits for them
    (``seconds`` at most: a node that left earlier never says so), so that no node's close meets a store
    already gone, which makes torch print a C++ stack trace there after a job that succeeded."""
    if nodes.rdzv_backend != "c10d" or nodes.store is None:
        return
    store = tdist.PrefixStore(f"dtrain-join/{nodes.run_id}", nodes.store)
    try:
        if not nodes.is_host:
            store.add(DONE, 1)
            return
        others = int(store.add(Keys.ARRIVALS, 0)) - 1
        deadline = time.monotonic() + seconds
        while int(store.add(DONE, 0)) < others and time.monotonic() < deadline:
            time.sleep(0.05)
    except (RuntimeError, OSError):  # the host is gone already: nothing left to wait for
        return


def _check_late(store: Any, decision: Decision, mine: NodeReport, subject: tuple[str, str]) -> None:
    """A node arriving after the decision (c10d scale-up) joins only a job of the same config and slots."""
    first = min(decision.names, key=int)
    message = _check_reports([get_message(store.get(Keys.node(first)), NodeReport)], mine, subject)
    if message is not None:
        raise JoinError(f"{mine.label} cannot join the running job {decision.run_id!r}: {message}")


def _late_interface(decision: Decision, report: NodeReport, label: str) -> str:
    """A node arriving after the decision (c10d scale-up): the interface on the chosen network."""
    network = decision.network
    for data in report.interfaces:
        iface = netif.Interface.from_json(data)
        if network and any(str(n) == network for n in iface.networks):
            return iface.name
        if not network and iface.name in decision.names.values():
            return iface.name
    raise JoinError(f"{label} joined late and has no interface on the job's network "
                    f"{network or ', '.join(decision.names.values())}; set {netif.ENV_OVERRIDE}")


def _address_on(iface: netif.Interface, network: str | None) -> str:
    if network:
        net = ipaddress.ip_network(network)
        for addr in iface.ips:
            if ipaddress.ip_address(addr) in net:
                return addr
    return iface.ips[0]
