"""What the launcher decided for one run: the options it was given for several machines (``dtrain run`` and
``dtrain launch`` alike), how they become a :class:`~dtrain.launcher.rendezvous.Rendezvous`, how a script's
nodes meet (:func:`join_script_nodes`), and the plan ``dtrain run`` carries out (config, run directory,
checkpoint to resume from, how this node joins the others)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.config.schema import ExperimentConfig, Resources
from dtrain.errors import UserError
from dtrain.launcher.rendezvous import NodeLaunch, Rendezvous, parse_endpoint, parse_nnodes
from dtrain.launcher.runlock import RunLock


@dataclass(frozen=True)
class NodeArgs:
    """Multi-machine options of ``dtrain run`` and ``dtrain launch`` (None where not given)."""

    nnodes: str | None = None
    node_rank: int | None = None
    master: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None

    @classmethod
    def from_args(cls, args: Any) -> NodeArgs:
        return cls(*(getattr(args, name, None) for name in ("nnodes", "node_rank", "master", "rdzv_backend",
                                                             "rdzv_id")))

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.nnodes, self.node_rank, self.master, self.rdzv_backend, self.rdzv_id))

    def rendezvous(self, slots: int, slots_name: str, *, default_id: str, join_timeout: float, last_call: int,
                   source: str = "command line") -> Rendezvous | None:
        """Validate these options for a job of ``slots`` slots in all (``slots_name`` in messages: the key or
        flag that set it), split evenly across the nodes; None when they amount to this machine alone.
        Raises UserError (one line) for a bad value."""
        backend = self.rdzv_backend or "static"
        if backend not in ("static", "c10d"):
            raise UserError(f"--rdzv-backend {backend!r}: expected 'static' (node ranks given) or 'c10d' (elastic)")
        low, high = parse_nnodes(self.nnodes or "1")
        if backend == "static" and low != high:
            raise UserError(f"--nnodes {self.nnodes}: an elastic range needs --rdzv-backend c10d; with static "
                            "rendezvous give a fixed node count")
        if high == 1 and backend == "static":
            if self.node_rank not in (None, 0):
                raise UserError(f"--node-rank {self.node_rank} is out of range for --nnodes 1 (valid: 0)")
            return None
        if self.master is None:
            raise UserError(f"--nnodes {self.nnodes} needs --master HOST:PORT, the address of the node hosting the "
                            "rendezvous (node 0), the same on every node")
        host, port = parse_endpoint(self.master)
        node_rank = self.node_rank
        if backend == "static":
            if node_rank is None:
                raise UserError(f"--nnodes {high} with static rendezvous needs --node-rank (0 to {high - 1}) on every "
                                "node, or use --rdzv-backend c10d to have ranks assigned")
            if not 0 <= node_rank < high:
                raise UserError(f"--node-rank {node_rank} is out of range for --nnodes {high}: valid node ranks are 0 "
                                f"to {high - 1}")
        else:
            node_rank = None
        if slots % high:
            raise UserError(f"{slots_name} {slots} does not divide across {high} nodes (--nnodes {self.nnodes}): "
                            f"every node runs the same number of slots; use a multiple of {high} (e.g. --slots "
                            f"{high * max(1, slots // high)}) or a node count that divides {slots}")
        return Rendezvous(backend, host, port, low, high, node_rank, self.rdzv_id or default_id, join_timeout, source,
                          last_call)


def script_nodes(nodes: NodeArgs, script: Path, args: list[str], slots: int, max_restarts: int,
                 host_prepare: Callable[[], dict] = dict,
                 node_check: Callable[[dict], None] = lambda plan: None) -> tuple[NodeLaunch | None, int]:
    """``dtrain launch``'s node options, checked as ``dtrain run``'s are (``--slots`` is the job's total, split
    evenly across the nodes), then the nodes met (:func:`join_script_nodes`); how this node's agent joins
    the others (None: this machine alone) and its slot count. A script has no config: the join waits, and an
    elastic range gathers nodes, as long as a config's defaults say (``resources.join_timeout_seconds``,
    ``resources.rendezvous_last_call_seconds``)."""
    defaults = Resources()
    rdzv = nodes.rendezvous(slots, "--slots", default_id=f"dtrain-launch-{script.stem}",
                            join_timeout=defaults.join_timeout_seconds,
                            last_call=defaults.rendezvous_last_call_seconds)
    if rdzv is None:
        return None, slots
    if rdzv.min_nodes < rdzv.max_nodes:
        # dtrain's own elastic agent stops every rank at one checkpoint before a membership change
        # (dtrain.launcher.elastic); a script has no such stop: torch's agent restarts its workers instead.
        print(f"dtrain: --nnodes {nodes.nnodes} is elastic: when a node joins or leaves, every node's workers "
              "restart (as under torchrun); the script must resume from its own checkpoint", flush=True)
    return join_script_nodes(rdzv, script, args, slots, max_restarts, host_prepare, node_check), \
        slots // rdzv.max_nodes


def script_digest(script: Path) -> str:
    """The script's content, hashed: every node of a ``dtrain launch`` job must run the same code."""
    return hashlib.sha256(script.read_bytes()).hexdigest()[:16]


def join_script_nodes(rdzv: Rendezvous, script: Path, args: list[str], slots: int, max_restarts: int,
                      host_prepare: Callable[[], dict] = dict,
                      node_check: Callable[[dict], None] = lambda plan: None) -> NodeLaunch:
    """``dtrain launch`` on several machines: meet the other nodes through the same pre-rendezvous as
    ``dtrain run`` (:func:`dtrain.launcher.join.join`); what they must agree on is the script (by name and
    content, not by path: machines may keep it in different places), its arguments and the slot counts.
    ``host_prepare``/``node_check``: as for :func:`~dtrain.launcher.join.join` (a run directory the host
    makes and the others check); by default there is none."""
    from dtrain.launcher.join import join  # torch's store: only once several machines were asked for

    same = {"script": script.name, "script_sha256": script_digest(script), "args": list(args), "slots": slots,
            "max_restarts": max_restarts}
    # No config, so no resources.network_interface: DTRAIN_NETWORK_INTERFACE or GLOO_SOCKET_IFNAME still apply.
    nodes, _ = join(rdzv, same, slots // rdzv.max_nodes, None, host_prepare, node_check,
                    what="script", fix="start every node with the same script (the same file), arguments, --slots "
                    "and --max-restarts")
    return nodes


@dataclass(frozen=True)
class RunPlan:
    config: ExperimentConfig
    run_dir: Path
    resume_from: Path | None
    # Several machines: how this node's agent joins the others.
    nodes: NodeLaunch | None = None
    # Inside torchrun/srun workers: train in this very process (no agent).
    in_place: bool = False
    # Whether this process reports for the whole run (prints the run directory and summary).
    chief: bool = True
    keepalive: Any = field(default=None, compare=False, repr=False)
    # The run directory's lock, held by this process for the whole run (None: another node holds it).
    lock: RunLock | None = field(default=None, compare=False, repr=False)
