"""Starting workers on PyTorch's own elastic agent (the engine behind ``torchrun``).

dtrain adds only what the agent does not do: a run directory, per-rank logs, and on failure one
readable line naming the failing rank and its root cause instead of the agent's wall of text.

Across machines, every node runs ``dtrain run`` and torch's rendezvous (static: node ranks given;
c10d: assigned, for elastic jobs) joins them. Before it, :func:`join` holds a short pre-rendezvous on a
``TCPStore`` at the same HOST:PORT (torch's rendezvous reuses that very store server): each node reports
its interfaces and config, the node hosting the store checks that everyone arrived within the join
timeout (naming the missing nodes otherwise), that the configs agree, picks the network interface
(:mod:`dtrain.netif`) and the run directory, and every node checks its interface reaches the master.
Only then does any worker start, so a bad setup costs one line on every node and no half-started job.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as tdist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from dtrain import netif
from dtrain.errors import UserError
from dtrain.worker import ERROR_FILE


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


@dataclass(frozen=True)
class Failure:
    rank: int
    exit_code: int
    message: str
    user_error: bool


def _threads_per_worker(slots: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // slots)


def _quiet_agent(debug: bool) -> None:
    # The agent logs every failure at ERROR with a long banner; dtrain prints the root cause instead.
    level = logging.INFO if debug else logging.CRITICAL
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run"):
        logging.getLogger(name).setLevel(level)


def launch(command: list[str], options: LaunchOptions) -> Failure | None:
    """Run ``command`` (a Python module or script and its args) on ``options.slots`` local workers.

    Returns None on success, else the first (root-cause) failure.
    """
    _quiet_agent(options.debug)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads_per_worker(options.slots)))
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
    config = LaunchConfig(
        nproc_per_node=options.slots,
        max_restarts=options.max_restarts,
        monitor_interval=0.1,
        logs_specs=logs_specs,
        **rdzv,
    )
    try:
        elastic_launch(config, sys.executable)(*command)
    except ChildFailedError as exc:
        return _root_cause(exc, options.run_dir)
    except RendezvousError as exc:
        # A node that passed dtrain's pre-rendezvous but never reached torch's (it died in between).
        raise JoinError(f"torch's rendezvous at {nodes.rdzv_endpoint if nodes else 'localhost'} failed: "
                        f"{exc}; check that every node is still running") from None
    return None


# Errors a rank gets because *another* rank died: never the root cause when a better candidate exists.
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing",
              "connectFullMesh")
_AGENT_KILL = {-15, 143}  # SIGTERM: the agent stopping the survivors


def _root_cause(exc: ChildFailedError, run_dir: Path | None) -> Failure:
    """The failure to show: bad input first, then the earliest genuine error, then a rank that died
    without a word (killed, os._exit), and only then the peers' "connection closed" echoes."""
    reports = _error_reports(run_dir, own_ranks=set(exc.failures))
    user = [r for r in reports if r["user_error"]]
    if user:
        return _from_report(min(user, key=lambda r: r["time"]))
    primary = [r for r in reports if not any(p in r["message"] for p in _SECONDARY)]
    if primary:
        return _from_report(min(primary, key=lambda r: r["time"]))
    reported = {r["rank"] for r in reports}
    for rank, failure in sorted(exc.failures.items()):
        if rank not in reported and failure.exitcode not in _AGENT_KILL:
            how = (f"killed by signal {failure.signal_name()}" if failure.exitcode < 0
                   else f"exited with code {failure.exitcode} without raising an exception")
            return Failure(rank, 1, how, user_error=False)
    if reports:
        return _from_report(min(reports, key=lambda r: r["time"]))
    rank, failure = exc.get_first_failure()
    return Failure(rank, 1, f"exited with code {failure.exitcode}", user_error=False)


def _error_reports(run_dir: Path | None, own_ranks: set[int] | None = None) -> list[dict]:
    """Every rank's error report; this node's own (``own_ranks``; None = all) are consumed."""
    if run_dir is None:
        return []
    reports = []
    for path in (run_dir / "logs").glob(ERROR_FILE.format(rank="*")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        reports.append(report)
        # Consumed, so a later attempt or resume starts clean; on shared storage, other nodes' reports
        # are left for their own launchers to read.
        if own_ranks is None or report.get("rank") in own_ranks:
            path.unlink(missing_ok=True)
    return reports


def _from_report(report: dict) -> Failure:
    message = report["message"] + (f" (at {report['where']})" if report.get("where") else "")
    return Failure(int(report["rank"]), int(report["exit_code"]), message, user_error=bool(report["user_error"]))


# ------------------------------------------------------------------------------------ multi-machine


class JoinError(UserError):
    """The nodes could not be brought together: a node missing, unreachable, or set up differently."""


@dataclass(frozen=True)
class Rendezvous:
    """Where and how this node meets the others (from the command line or a cluster's environment)."""

    backend: str  # "static" (node ranks given) or "c10d" (ranks assigned; elastic)
    host: str
    port: int
    min_nodes: int
    max_nodes: int
    node_rank: int | None  # static only
    rdzv_id: str
    join_timeout: float
    source: str = "command line"  # for messages: "command line", "Slurm", "PyTorchJob"

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class NodeLaunch:
    """What torch's agent needs to join the other nodes, as settled by :func:`join`."""

    min_nodes: int
    max_nodes: int
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_configs: Mapping[str, Any]
    run_id: str
    local_addr: str
    log_name: str
    ifname: str
    interface_reason: str
    is_host: bool
    label: str
    # The pre-rendezvous TCPStore: held until the agent is done, because torch's rendezvous reuses its
    # server (multi-tenant) on the store-hosting node.
    store: Any = field(default=None, compare=False, repr=False)


def parse_endpoint(text: str, flag: str = "--master") -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT``; UserError naming the flag otherwise."""
    host, sep, port_text = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    hint = f"expected HOST:PORT, e.g. {flag} 10.0.0.1:29500"
    if not sep or not host or not port_text:
        raise UserError(f"{flag} {text!r}: {hint}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise UserError(f"{flag} {text!r}: port {port_text!r} is not a number from 1 to 65535; {hint}")
    if any(c.isspace() for c in host) or ("/" in host):
        raise UserError(f"{flag} {text!r}: {host!r} is not a host name or address; {hint}")
    return host, int(port_text)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (an elastic range, c10d only) -> (min, max)."""
    lo, sep, hi = text.partition(":")
    try:
        low, high = (int(lo), int(hi)) if sep else (int(text), int(text))
    except ValueError:
        raise UserError(f"--nnodes {text!r}: expected a node count N or an elastic range MIN:MAX, "
                        "e.g. 2 or 1:4") from None
    if low < 1 or high < low:
        raise UserError(f"--nnodes {text!r}: need 1 <= MIN <= MAX, got {low}:{high}")
    return low, high


def _is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def _wait_key(store: Any, key: str, deadline: float, poll: float = 0.05) -> bytes | None:
    """The value of ``key`` once set, or None at ``deadline``. Polls ``check`` instead of ``wait``:
    a timed-out ``wait`` makes torch's C++ side print warnings, and failing here must stay one line."""
    while time.monotonic() < deadline:
        if store.check([key]):
            return store.get(key)
        time.sleep(poll)
    return None


def config_digest(config_dict: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config_dict, sort_keys=True).encode()).hexdigest()[:16]


def first_difference(a: Any, b: Any, prefix: str = "") -> str:
    """The first key path where two config mappings differ, with both values."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            if a.get(key) != b.get(key):
                return first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
    return f"{prefix.rstrip('.') or 'config'}: {a!r} vs {b!r}"


def join(rdzv: Rendezvous, config_dict: Mapping[str, Any], slots_per_node: int, iface_setting: str | None,
         host_prepare: Callable[[], dict], node_check: Callable[[dict], None],
         host_abort: Callable[[], None] = lambda: None) -> tuple[NodeLaunch, dict]:
    """Meet the other nodes before torch's rendezvous; return how to launch and the host's run plan.

    ``config_dict`` must be the same on every node (compared by digest). On the node hosting the
    store, ``host_prepare()`` makes the run directory once every node has joined and returns the plan
    (run dir, resume point) every node uses; elsewhere ``node_check(plan)`` verifies it (shared
    storage). ``host_abort()`` undoes ``host_prepare`` if a later check fails. Raises JoinError.
    """
    hostname = socket.gethostname()
    master_ip = netif.resolve_ipv4(rdzv.host)
    loopback = _is_loopback(master_ip)
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

    # The interface this node would use on its own: forced, or the one its route to the master takes.
    forced = netif.override(iface_setting)
    forced_iface = netif.check_override(forced[0], forced[1], hostname) if forced else None
    if loopback:
        src_name, src_ip = "lo", "127.0.0.1"
    elif forced_iface is not None:
        src_name, src_ip = forced_iface.name, forced_iface.ips[0]
        # A device-bound socket makes the kernel try any address as if on that link, so a wrong
        # interface would only show as a timeout: reject the plain mismatch at once.
        route = netif.route_interface(master_ip)
        if route != forced_iface.name and not any(ipaddress.ip_address(master_ip) in n for n in forced_iface.networks):
            name, addresses = forced_iface.name, ", ".join(forced_iface.addresses)
            raise JoinError(f"{me} on host {hostname}: interface {name} ({addresses}; set by {forced[1]}) does not "
                            f"reach the master {rdzv.endpoint} ({master_ip}): tried the route lookup to {master_ip}: "
                            f"it leaves through {route or 'no interface (no route)'}, and {master_ip} is not on "
                            f"{name}'s network; set {netif.ENV_OVERRIDE} to {route or 'an interface that reaches it'}, "
                            "or remove the setting to auto-detect")
    else:
        try:
            src_ip = netif.route_source(master_ip)
        except OSError as exc:
            raise JoinError(f"{me} on host {hostname} has no route to the master {rdzv.endpoint} ({master_ip}): "
                            f"{exc.strerror or exc}; pass a --master address this host can reach") from None
        found = netif.interface_for_ip(src_ip, netif.list_interfaces(include_excluded=True))
        src_name = found.name if found else "?"
    label = f"{me} (host {hostname}, {src_ip})"
    deadline = time.monotonic() + rdzv.join_timeout
    timeout = timedelta(seconds=max(1.0, rdzv.join_timeout))

    # Reach the store. The host serves it; the others first wait until it accepts a connection from
    # the chosen interface (also the reachability check of a forced interface), so torch's C++ client
    # never retries noisily.
    if is_host:
        try:
            server = tdist.TCPStore(master_ip, rdzv.port, None, True, timeout, wait_for_workers=False,
                                    multi_tenant=True)
        except (RuntimeError, OSError) as exc:
            if rdzv.backend == "static":
                raise JoinError(f"{me} cannot serve the rendezvous on port {rdzv.port} of host {hostname}: "
                                f"{str(exc).splitlines()[0]}; choose a free port in --master HOST:PORT") from None
            # c10d with several nodes on the master's machine: another one serves already (torch's
            # c10d backend does the same fallback).
            is_host = False
    if not is_host:
        problem = netif.wait_listening(src_name, src_ip, master_ip, rdzv.port, deadline)
        if problem is not None:
            source = f" (from {forced[1]})" if forced else ""
            raise JoinError(f"{label} cannot reach the master {rdzv.endpoint} within {rdzv.join_timeout:g}s "
                            f"(resources.join_timeout_seconds): tried a TCP connect from {src_ip} on interface "
                            f"{src_name}{source} to {master_ip}:{rdzv.port}: {problem}; check that node 0 was "
                            f"started with the same --master, that the address is right and the port open"
                            + (f", or set {netif.ENV_OVERRIDE} to an interface that reaches it" if forced else ""))
        try:
            server = tdist.TCPStore(master_ip, rdzv.port, None, False, timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise JoinError(f"{label} lost the master {rdzv.endpoint}: {str(exc).splitlines()[0]}") from None
    store = tdist.PrefixStore(f"dtrain-join/{rdzv.rdzv_id}", server)

    report = {
        "label": label, "hostname": hostname, "ip": src_ip,
        "interfaces": [i.to_json() for i in ([forced_iface] if forced_iface else netif.list_interfaces())],
        "forced": forced[0] if forced else None, "master_route": src_name, "slots": slots_per_node,
        "config": dict(config_dict), "digest": config_digest(config_dict),
    }
    key = _announce(store, rdzv, report, label)
    if is_host:
        decision = _host_decide(store, rdzv, report, key, deadline, loopback, host_prepare, label)
    else:
        raw = _wait_key(store, "decision", deadline + 30)
        if raw is None:
            raise JoinError(f"{label} joined, but the node hosting {rdzv.endpoint} never answered; is it still "
                            "running? (see its output)")
        decision = json.loads(raw)
        store.add("decision_seen", 1)
        if not decision["ok"]:
            raise JoinError(decision["message"])

    # Settle this node's interface and check it reaches the host's address on that network.
    ifname = decision["names"].get(str(key)) or _late_interface(decision, report, label)
    iface = next((netif.Interface.from_json(i) for i in report["interfaces"] if i["name"] == ifname), None)
    local_ip = "127.0.0.1" if loopback else _address_on(iface, decision.get("network")) if iface else src_ip
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    os.environ["NCCL_SOCKET_IFNAME"] = ifname
    if not is_host:
        problem = None
        try:
            node_check(decision["plan"])
        except UserError as exc:
            problem = f"{label}: {exc}"
        if problem is None and not loopback:
            probe = netif.probe(ifname, local_ip, decision["target_ip"], rdzv.port, timeout=min(5.0, rdzv.join_timeout))
            if probe is not None:
                problem = (f"{label}: interface {ifname} ({local_ip}) does not reach the master host: tried a TCP "
                           f"connect from {local_ip} on {ifname} to {decision['target_ip']}:{rdzv.port} "
                           f"({decision['host_label']}'s address on {decision['host_ifname']}): {probe}; set "
                           f"{netif.ENV_OVERRIDE} on this node to an interface that reaches it")
        store.set(f"ack/{key}", json.dumps({"ok": problem is None, "message": problem or ""}))
        if problem is not None:
            raise JoinError(problem)
        raw = _wait_key(store, "go", time.monotonic() + max(30.0, rdzv.join_timeout))
        go = json.loads(raw) if raw is not None else {"ok": False, "message": f"{label}: the host never said go"}
        if raw is not None:
            store.add("go_seen", 1)
        if not go["ok"]:
            raise JoinError(go["message"])
    else:
        waiting = [k for k in decision["names"] if k != str(key)]
        acks_deadline = time.monotonic() + max(30.0, rdzv.join_timeout)
        problems = []
        for k in waiting:
            raw = _wait_key(store, f"ack/{k}", acks_deadline)
            ack = json.loads(raw) if raw is not None else {"ok": False, "message": f"node {k} never confirmed its "
                                                           "network check"}
            if not ack["ok"]:
                problems.append(ack["message"])
        store.set("go", json.dumps({"ok": not problems, "message": "; ".join(problems)}))
        if problems:
            host_abort()
            _linger(store, "go", len(waiting))
            raise JoinError("; ".join(problems))

    node_rank = rdzv.node_rank
    configs: dict[str, Any]
    if rdzv.backend == "static":
        configs = {"rank": node_rank, "timeout": int(max(1, rdzv.join_timeout))}
    else:
        configs = {"join_timeout": int(max(1, rdzv.join_timeout)), "is_host": is_host,
                   "last_call_timeout": 5 if rdzv.min_nodes < rdzv.max_nodes else 1}
    log_name = f"node{node_rank}" if node_rank is not None else f"{hostname}-{local_ip}"
    launch_info = NodeLaunch(
        min_nodes=rdzv.min_nodes, max_nodes=rdzv.max_nodes, rdzv_backend=rdzv.backend,
        rdzv_endpoint=f"{master_ip}:{rdzv.port}", rdzv_configs=configs, run_id=decision["run_id"],
        local_addr=local_ip, log_name=log_name, ifname=ifname, is_host=is_host, label=label, store=server,
        interface_reason=decision["reason"] if str(key) in decision["names"] else "joined late: the job's network")
    return launch_info, decision["plan"]


def _announce(store: Any, rdzv: Rendezvous, report: dict, label: str) -> int | str:
    """Publish this node's report; returns its key (static: node rank; c10d: arrival number)."""
    if rdzv.backend == "static":
        key: int | str = int(rdzv.node_rank or 0)
        if store.add(f"claim/{key}", 1) > 1:
            store.set(f"dup/{key}", label)
            raise JoinError(f"{label}: node rank {key} was already taken by another node; give every node its own "
                            f"--node-rank from 0 to {rdzv.max_nodes - 1}")
    else:
        key = store.add("arrivals", 1) - 1
    store.set(f"node/{key}", json.dumps(report))
    return key


def _host_decide(store: Any, rdzv: Rendezvous, report: dict, key: int | str, deadline: float, loopback: bool,
                 host_prepare: Callable[[], dict], label: str) -> dict:
    """On the store host: wait for every node, check them, choose the interface, make the run plan."""
    reports: dict[str, dict] = {str(key): report}
    expected = [str(r) for r in range(rdzv.max_nodes)] if rdzv.backend == "static" else None
    message = None
    while True:
        if expected is not None:
            dups = [r for r in expected if store.check([f"dup/{r}"])]
            if dups:
                message = (f"two nodes were started with --node-rank {dups[0]} ({store.get(f'dup/{dups[0]}').decode()} "
                           f"and another); give every node its own --node-rank from 0 to {rdzv.max_nodes - 1}")
                break
            keys = expected
        else:
            keys = [str(i) for i in range(int(store.add("arrivals", 0)))]
        for k in keys:
            if k not in reports and store.check([f"node/{k}"]):
                reports[k] = json.loads(store.get(f"node/{k}"))
        arrived = len(reports)
        if (expected is not None and arrived == len(expected)) or (expected is None and arrived >= rdzv.min_nodes):
            break
        if time.monotonic() >= deadline:
            joined = ", ".join(r["label"] for _, r in sorted(reports.items()))
            if expected is not None:
                missing = [k for k in expected if k not in reports]
                message = (f"node{'s' if len(missing) > 1 else ''} {', '.join(missing)} of {rdzv.max_nodes} never "
                           f"joined the rendezvous at {rdzv.endpoint} within {rdzv.join_timeout:g}s "
                           f"(resources.join_timeout_seconds); joined: {joined}; start the missing node with "
                           f"--node-rank {missing[0]} --master {rdzv.endpoint}, or check that it can reach that "
                           "address")
            else:
                message = (f"only {arrived} of {rdzv.min_nodes} nodes joined the c10d rendezvous {rdzv.rdzv_id!r} at "
                           f"{rdzv.endpoint} within {rdzv.join_timeout:g}s (resources.join_timeout_seconds); "
                           f"joined: {joined}; start the missing {rdzv.min_nodes - arrived} node(s) with the same "
                           "--master and --rdzv-id")
            break
        time.sleep(0.05)
    keys = sorted(reports, key=int)
    ordered = [reports[k] for k in keys]
    choice = None
    if message is None:
        message = _check_reports(ordered, report, rdzv)
    if message is None:
        try:
            choice = _choose_names(ordered, loopback)
        except UserError as exc:
            message = str(exc)
    if message is not None or choice is None:
        store.set("decision", json.dumps({"ok": False, "message": message}))
        _linger(store, "decision", len(reports) - 1)
        raise JoinError(str(message))
    host_ifname = choice.names[keys.index(str(key))]
    host_iface = None if loopback else next(netif.Interface.from_json(i) for i in report["interfaces"]
                                            if i["name"] == host_ifname)
    target_ip = "127.0.0.1" if host_iface is None else _address_on(host_iface, choice.network)
    try:
        plan = host_prepare()
    except UserError as exc:
        store.set("decision", json.dumps({"ok": False, "message": f"{label}: {exc}"}))
        _linger(store, "decision", len(reports) - 1)
        raise
    decision = {
        "ok": True, "names": dict(zip(keys, choice.names, strict=True)),
        "network": choice.network, "reason": choice.reason, "target_ip": target_ip,
        "host_label": label, "host_ifname": host_ifname,
        "run_id": rdzv.rdzv_id if rdzv.backend == "c10d" else f"dtrain-{uuid.uuid4().hex[:8]}", "plan": plan,
    }
    store.set("decision", json.dumps(decision))
    log = logging.getLogger("dtrain")
    log.info("network interface: %s (%s)", ", ".join(dict.fromkeys(choice.names)), choice.reason)
    return decision


def _check_reports(reports: list[dict], mine: dict, rdzv: Rendezvous) -> str | None:
    for other in reports:
        if other["digest"] != mine["digest"]:
            diff = first_difference(mine["config"], other["config"])
            return (f"{other['label']} has a different experiment config than {mine['label']} ({diff}); start every "
                    "node with the same config file and --set/--slots options")
        if other["slots"] != mine["slots"]:
            return (f"{other['label']} would run {other['slots']} slot(s) but {mine['label']} {mine['slots']}; start "
                    "every node with the same --nnodes and --slots")
    return None


def _choose_names(reports: list[dict], loopback: bool) -> netif.Choice:
    if loopback:  # every node on this very machine
        return netif.Choice(names=tuple("lo" for _ in reports), reason="master on loopback")
    nodes = [netif.NodeInterfaces(r["label"], tuple(netif.Interface.from_json(i) for i in r["interfaces"]),
                                  r["master_route"]) for r in reports]
    return netif.choose_common(nodes)


def _late_interface(decision: dict, report: dict, label: str) -> str:
    """A node arriving after the decision (c10d scale-up): the interface on the chosen network."""
    network = decision.get("network")
    for data in report["interfaces"]:
        iface = netif.Interface.from_json(data)
        if network and any(str(n) == network for n in iface.networks):
            return iface.name
        if not network and iface.name in decision["names"].values():
            return iface.name
    raise JoinError(f"{label} joined late and has no interface on the job's network "
                    f"{network or ', '.join(decision['names'].values())}; set {netif.ENV_OVERRIDE}")


def _address_on(iface: netif.Interface, network: str | None) -> str:
    if network:
        net = ipaddress.ip_network(network)
        for addr in iface.ips:
            if ipaddress.ip_address(addr) in net:
                return addr
    return iface.ips[0]


def _linger(store: Any, what: str, readers: int, seconds: float = 3.0) -> None:
    """Keep the store up briefly after a failure, so the other nodes read why (not just "connection
    lost"). ``readers`` nodes acknowledge by bumping ``<what>_seen``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and int(store.add(f"{what}_seen", 0)) < readers:
        time.sleep(0.05)
