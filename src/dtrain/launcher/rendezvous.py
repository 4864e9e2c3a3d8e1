"""The words nodes exchange before torch's rendezvous: where to meet (:class:`Rendezvous`), what each
node reports, what the host decides, the answers, every store key (:class:`Keys`), and what the agent is
finally given (:class:`NodeLaunch`). The protocol itself is :mod:`dtrain.launcher.join`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from dtrain.errors import UserError


class JoinError(UserError):
    """The nodes could not be brought together: a node missing, unreachable, or set up differently."""


# ---------------------------------------------------------------------------------------- inputs


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
    last_call: int = 5  # an elastic range's wait for more nodes (resources.rendezvous_last_call_seconds)

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
    # It arrived after the job was formed (c10d): it joins a running job, and must not touch its files.
    late: bool = False
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


# -------------------------------------------------------------------------------------- messages


class Keys:
    """Every key the protocol uses, under the store prefix ``dtrain-join/<rdzv id>``."""

    ARRIVALS = "arrivals"  # c10d: a counter handing out arrival numbers
    DECISION = "decision"
    GO = "go"

    @staticmethod
    def node(key: str) -> str:
        return f"node/{key}"

    @staticmethod
    def claim(key: str) -> str:  # static: a node rank taken
        return f"claim/{key}"

    @staticmethod
    def duplicate(key: str) -> str:  # static: a second node with the same rank
        return f"dup/{key}"

    @staticmethod
    def ack(key: str) -> str:
        return f"ack/{key}"

    @staticmethod
    def seen(what: str) -> str:  # readers of DECISION/GO count themselves here
        return f"{what}_seen"


@dataclass(frozen=True)
class NodeReport:
    """What a node tells the host about itself."""

    label: str
    hostname: str
    ip: str
    interfaces: list[dict[str, Any]]
    forced: str | None
    master_route: str
    slots: int
    config: dict[str, Any]
    digest: str


@dataclass(frozen=True)
class Decision:
    """The host's verdict: refused with a message, or the interface per node and the run plan."""

    ok: bool
    message: str = ""
    names: dict[str, str] = field(default_factory=dict)  # node key -> interface name
    network: str | None = None
    reason: str = ""
    target_ip: str = ""
    host_label: str = ""
    host_ifname: str = ""
    run_id: str = ""
    plan: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """A node's ``ack`` to the decision, and the host's final ``go``."""

    ok: bool
    message: str = ""


def put_message(store: Any, key: str, message: Any) -> None:
    store.set(key, json.dumps(asdict(message)))


def get_message(raw: bytes, kind: type) -> Any:
    return kind(**json.loads(raw))


def wait_key(store: Any, key: str, deadline: float, poll: float = 0.05) -> bytes | None:
    """The value of ``key`` once set, or None at ``deadline``. Polls ``check`` instead of ``wait``:
    a timed-out ``wait`` makes torch's C++ side print warnings, and failing here must stay one line."""
    while time.monotonic() < deadline:
        if store.check([key]):
            return store.get(key)
        time.sleep(poll)
    return None


def linger(store: Any, what: str, readers: int, seconds: float = 3.0) -> None:
    """Keep the store up briefly after a failure, so the other nodes read why (not just "connection
    lost"). ``readers`` nodes acknowledge by bumping ``Keys.seen(what)``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and int(store.add(Keys.seen(what), 0)) < readers:
        time.sleep(0.05)


def config_digest(config_dict: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config_dict, sort_keys=True).encode()).hexdigest()[:16]


def first_difference(a: Any, b: Any, prefix: str = "") -> str:
    """The first key path where two config mappings differ, with both values."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            if a.get(key) != b.get(key):
                return first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
    return f"{prefix.rstrip('.') or 'config'}: {a!r} vs {b!r}"
