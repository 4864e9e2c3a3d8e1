"""Which network interface the collectives use on a multi-machine job.

Gloo (and NCCL's bootstrap) pick an address from the host name unless ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` name an interface. On real clusters the host name often resolves to a management
network, a container bridge or loopback, and a job then hangs or crawls. dtrain therefore chooses the
interface explicitly:

1. an override wins: the ``DTRAIN_NETWORK_INTERFACE`` environment variable (per node, so names may
   differ between nodes), else ``resources.network_interface`` in the config, else a ``GLOO_SOCKET_IFNAME``
   already set in the environment;
2. otherwise every node lists its interfaces (:func:`list_interfaces`: up, with an IPv4 address, not
   loopback, not a container bridge or bridge port) and the launcher hosting the rendezvous picks one
   network common to all nodes (:func:`choose_common`):

   * candidates are networks every node has an address in (*subnet match*: names may differ between
     nodes) and interface names every node has (*name match*);
   * the rule: the highest link speed known on every node of the candidate (the slowest node's speed
     counts, from ``/sys/class/net/IF/speed``); if no candidate has a known speed, the candidate the
     nodes' route to the master goes through; then subnet matches before name matches, then by name;
   * a master on loopback (every node on one machine) means ``lo``.

Then every node checks that the chosen interface reaches the master (:func:`probe`) before any worker
starts, so a wrong choice is one clear line instead of a hang.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.errors import UserError

ENV_OVERRIDE = "DTRAIN_NETWORK_INTERFACE"
SYS_NET = Path("/sys/class/net")

# Interfaces that exist for containers or overlays on *this* host, never the path between machines.
_CONTAINER_IFACE = re.compile(
    r"^(docker\d*|br-[0-9a-f]{12}|virbr\d+(-nic)?|cni\d*|podman\d+|lxcbr\d+|lxdbr\d+|cali[0-9a-f]+|"
    r"flannel[.\w-]*|vxlan\.calico|weave|kube-[\w-]+|tunl\d+|veth[0-9a-f]{7,}|cilium_[\w]+|nerdctl\d+)$"
)


@dataclass(frozen=True)
class Interface:
    """One network interface of this host: name, IPv4 addresses with prefix, link speed in Mbit/s."""

    name: str
    addresses: tuple[str, ...]  # "10.0.0.2/24"
    speed_mbps: int | None = None

    @property
    def networks(self) -> list[ipaddress.IPv4Network]:
        return [ipaddress.ip_interface(a).network for a in self.addresses]  # type: ignore[misc]

    @property
    def ips(self) -> list[str]:
        return [a.split("/")[0] for a in self.addresses]

    def describe(self) -> str:
        speed = f", {self.speed_mbps} Mbit/s" if self.speed_mbps else ""
        return f"{self.name} ({', '.join(self.addresses) or 'no IPv4'}{speed})"

    def to_json(self) -> dict:
        return {"name": self.name, "addresses": list(self.addresses), "speed_mbps": self.speed_mbps}

    @classmethod
    def from_json(cls, data: Mapping) -> Interface:
        return cls(str(data["name"]), tuple(data["addresses"]), data.get("speed_mbps"))


@dataclass(frozen=True)
class NodeInterfaces:
    """What one node reports before the rendezvous: its label, candidate interfaces, and the interface
    its route to the master leaves through (None when unknown)."""

    label: str
    interfaces: tuple[Interface, ...]
    master_route: str | None = None

    def get(self, name: str) -> Interface | None:
        return next((i for i in self.interfaces if i.name == name), None)


@dataclass(frozen=True)
class Choice:
    """The interface each node uses (index = node position in the list given to :func:`choose_common`)."""

    names: tuple[str, ...]
    reason: str
    network: str | None = None
    candidates: tuple[str, ...] = field(default=())


# -------------------------------------------------------------------------------------------- listing


def link_speed(name: str) -> int | None:
    """Link speed in Mbit/s from sysfs; None when the driver does not say (virtual links, down links)."""
    try:
        value = int((SYS_NET / name / "speed").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value > 0 else None


def _is_bridge_port(name: str) -> bool:
    return (SYS_NET / name / "brport").exists() or (SYS_NET / name / "master").exists()


def excluded(name: str, loopback: bool = False) -> bool:
    """Loopback and container/overlay interfaces are never the link between machines."""
    return loopback or name == "lo" or bool(_CONTAINER_IFACE.match(name))


def list_interfaces(include_excluded: bool = False) -> list[Interface]:
    """This host's usable interfaces: up, with an IPv4 address, not loopback, not a container bridge."""
    raw = _ip_addr_json()
    found = []
    for entry in raw:
        name = entry.get("ifname", "")
        flags = entry.get("flags", [])
        loopback = "LOOPBACK" in flags
        unusable = excluded(name, loopback) or "UP" not in flags or entry.get("master") or _is_bridge_port(name)
        if unusable and not include_excluded:
            continue
        addrs = tuple(f"{a['local']}/{a['prefixlen']}" for a in entry.get("addr_info", [])
                      if a.get("family") == "inet" and "local" in a)
        if not addrs and not include_excluded:
            continue
        found.append(Interface(name, addrs, link_speed(name)))
    return found


def _ip_addr_json() -> list[dict]:
    """``ip -j addr`` when iproute2 is installed; else sysfs plus ioctl (first IPv4 address only)."""
    ip = shutil.which("ip")
    if ip is not None:
        try:
            out = subprocess.run([ip, "-j", "addr", "show"], capture_output=True, text=True, timeout=10, check=True)
            return json.loads(out.stdout)
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    return _ioctl_addrs()


def _ioctl_addrs() -> list[dict]:
    import fcntl
    import struct

    siocgifaddr, siocgifnetmask, siocgifflags = 0x8915, 0x891B, 0x8913
    entries = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), siocgifflags, req)[16:18])[0]
            except OSError:
                continue
            entry: dict = {"ifname": name, "flags": (["UP"] if flags & 0x1 else []) + (["LOOPBACK"] if flags & 0x8
                                                                                          else []), "addr_info": []}
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifnetmask, req)[20:24])
                prefix = ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen
                entry["addr_info"].append({"family": "inet", "local": addr, "prefixlen": prefix})
            except OSError:
                pass
            entries.append(entry)
    return entries


def interface_for_ip(ip: str, interfaces: Sequence[Interface]) -> Interface | None:
    return next((i for i in interfaces if ip in i.ips), None)


def local_ips() -> set[str]:
    """Every IPv4 address of this host (loopback included)."""
    return {ip for i in list_interfaces(include_excluded=True) for ip in i.ips}


def route_source(dest_ip: str) -> str:
    """The source address the kernel would use to reach ``dest_ip``. Connecting a UDP socket only looks
    the route up; nothing is sent. Raises OSError (e.g. ENETUNREACH) when there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((dest_ip, 9))
        return s.getsockname()[0]


def route_interface(dest_ip: str, interfaces: Sequence[Interface] | None = None) -> str | None:
    """Name of the interface the route to ``dest_ip`` leaves through, or None (no route / not listed)."""
    try:
        src = route_source(dest_ip)
    except OSError:
        return None
    found = interface_for_ip(src, interfaces if interfaces is not None else list_interfaces(include_excluded=True))
    return found.name if found else None


def resolve_ipv4(host: str) -> str:
    """The IPv4 address of ``host``; UserError when it does not resolve."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError, UnicodeError) as exc:
        raise UserError(f"master host {host!r} does not resolve to an IPv4 address ({exc}); pass "
                        "--master HOST:PORT with a host name or address every node can reach") from None


# --------------------------------------------------------------------------------------------- choice


def override(config_value: str | None, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The interface forced for this node and where it came from, or None to auto-detect."""
    env = os.environ if environ is None else environ
    if env.get(ENV_OVERRIDE):
        return env[ENV_OVERRIDE], ENV_OVERRIDE
    if config_value:
        return config_value, "resources.network_interface"
    if env.get("GLOO_SOCKET_IFNAME"):
        return env["GLOO_SOCKET_IFNAME"], "GLOO_SOCKET_IFNAME"
    return None


def check_override(name: str, source: str, host: str) -> Interface:
    """The forced interface must exist here and carry an IPv4 address."""
    every = list_interfaces(include_excluded=True)
    found = next((i for i in every if i.name == name), None)
    have = ", ".join(i.describe() for i in every) or "none"
    if found is None:
        raise UserError(f"network interface {name!r} (from {source}) does not exist on host {host} (its "
                        f"interfaces: {have}); set {ENV_OVERRIDE} on this node to one of them, or remove "
                        "the setting to auto-detect")
    if not found.addresses:
        raise UserError(f"network interface {name!r} (from {source}) on host {host} has no IPv4 address "
                        f"(its interfaces: {have}); choose an interface with an address")
    return found


def choose_common(nodes: Sequence[NodeInterfaces]) -> Choice:
    """Pick one network common to all nodes (see the module docstring for the rule).

    Raises UserError listing every node's interfaces when the nodes share none.
    """
    candidates: dict[tuple[str, ...], dict] = {}
    first = nodes[0]
    for iface in first.interfaces:  # subnet matches: names may differ between nodes
        for net in iface.networks:
            names = []
            for node in nodes:
                match = next((i for i in node.interfaces if net in i.networks), None)
                if match is None:
                    break
                names.append(match.name)
            else:
                candidates.setdefault(tuple(names), {"match": "subnet", "network": str(net)})
    for iface in first.interfaces:  # name matches: same name everywhere, whatever the addresses
        if all(node.get(iface.name) for node in nodes):
            candidates.setdefault(tuple(iface.name for _ in nodes), {"match": "name", "network": None})
    if not candidates:
        listing = "; ".join(f"{n.label}: {', '.join(i.describe() for i in n.interfaces) or 'none'}" for n in nodes)
        raise UserError(f"the nodes share no network interface (same name or same subnet): {listing}; set "
                        f"{ENV_OVERRIDE} on each node to the interface that connects them")

    def speed(names: tuple[str, ...]) -> int | None:
        speeds = [node.get(name).speed_mbps for node, name in zip(nodes, names, strict=True)]  # type: ignore[union-attr]
        return None if any(s is None for s in speeds) else min(speeds)  # type: ignore[type-var]

    def routes(names: tuple[str, ...]) -> int:
        return sum(node.master_route == name for node, name in zip(nodes, names, strict=True))

    def key(names: tuple[str, ...]) -> tuple:
        s = speed(names)
        return (s is not None, s or 0, routes(names), candidates[names]["match"] == "subnet")

    best = max(sorted(candidates), key=key)  # max keeps the first of equals: ties go by name
    info = candidates[best]
    best_speed = speed(best)
    if best_speed is not None:
        reason = f"fastest known link ({best_speed} Mbit/s)"
    elif routes(best):
        reason = "routes to the master"
    else:
        reason = "first common interface"
    reason += f", {info['match']} match" + (f" on {info['network']}" if info["network"] else "")
    described = tuple(f"{'/'.join(dict.fromkeys(c))} ({candidates[c]['match']})" for c in candidates)
    return Choice(names=best, reason=reason, network=info["network"], candidates=described)


# ---------------------------------------------------------------------------------------------- probe


def probe(ifname: str, source_ip: str, target_ip: str, port: int, timeout: float) -> str | None:
    """Can ``ifname`` reach ``target_ip:port``? None if yes, else what went wrong.

    A TCP connect from the interface's address (bound to the device when permitted; Gloo binds to the
    interface's address the same way). "Connection refused" also proves the path: the host answered.
    """
    exc = _try_connect(ifname, source_ip, target_ip, port, timeout)
    if exc is None or isinstance(exc, ConnectionRefusedError):
        return None
    return _describe(exc, timeout)


def wait_listening(ifname: str, source_ip: str, target_ip: str, port: int, deadline: float) -> str | None:
    """Connect until ``target_ip:port`` accepts or ``deadline`` (time.monotonic) passes; None on success.

    Refused or unanswered connections are retried (the master may start later than this node); a
    missing route is reported at once, since waiting cannot fix it.
    """
    start = time.monotonic()
    while True:
        remaining = deadline - time.monotonic()
        timeout = max(0.2, min(5.0, remaining))
        exc = _try_connect(ifname, source_ip, target_ip, port, timeout)
        if exc is None:
            return None
        retry = isinstance(exc, (ConnectionRefusedError, TimeoutError)) or exc.errno == errno.EHOSTUNREACH
        if not retry:
            return _describe(exc, timeout)
        if remaining <= 0:
            return f"{_describe(exc, timeout)}, retried for {time.monotonic() - start:.0f}s"
        time.sleep(0.2)


def _try_connect(ifname: str, source_ip: str, target_ip: str, port: int, timeout: float) -> OSError | None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Not root: no device binding; binding the source address below is what Gloo does too.
        with contextlib.suppress(OSError, AttributeError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, ifname.encode())
        s.settimeout(timeout)
        try:
            s.bind((source_ip, 0))
            s.connect((target_ip, port))
        except OSError as exc:
            return exc
    return None


def _describe(exc: OSError, timeout: float) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (the host answers but nothing listens on that port)"
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g}s"
    return f"{errno.errorcode.get(exc.errno or 0, 'error')} ({exc.strerror or exc})"
