"""What the launcher decided for one ``dtrain run``: the options it was given for several machines and the
plan it carries out (config, run directory, checkpoint to resume from, how this node joins the others)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.config.schema import ExperimentConfig
from dtrain.launcher.rendezvous import NodeLaunch
from dtrain.launcher.runlock import RunLock


@dataclass(frozen=True)
class NodeArgs:
    """Multi-machine options of ``dtrain run`` (None where not given)."""

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
