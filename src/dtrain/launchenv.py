"""What the launcher that started this process says about its place in the job: torch's elastic agent
(torchrun, dtrain's own), Slurm's ``srun`` and a Kubeflow PyTorchJob or TrainJob pod, read from the environment.

No torch here: ``dtrain run`` reads it before it imports torch, to know whether this process trains in place
(a launcher's worker) or starts workers of its own. :mod:`dtrain.dist` re-exports it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from dtrain.errors import UserError


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as told by the launcher."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    restart_count: int = 0
    # True when torch's elastic agent hosts the TCPStore (workers must connect as clients).
    agent_store: bool = False

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def launched(self) -> bool:
        """True when a launcher (torchrun, dtrain, Slurm via torchrun) set up this process."""
        return self.master_port != 0


def read_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launcher's variables; absent ones mean a single-process world.

    ``srun`` with one task per slot (no torchrun) sets only Slurm's variables: those are read instead.
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        cluster = read_cluster_env(env)
        if cluster is not None and cluster.source == "Slurm" and cluster.role == "worker":
            return cluster.worker_env()
        return DistEnv()
    try:
        return DistEnv(
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "0")),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        )
    except ValueError as exc:
        raise UserError(
            f"malformed launcher environment (RANK/WORLD_SIZE/...): {exc}; launch with dtrain or torchrun"
        ) from None


# ------------------------------------------------------------------------------- cluster launchers


@dataclass(frozen=True)
class ClusterEnv:
    """What a cluster launcher already decided for this process, read from its environment.

    ``role`` is "worker" when this process *is* one slot (torchrun's workers; ``srun`` with one task
    per slot): dtrain then trains in-process with the given rank. It is "node" when this process
    stands for a whole machine (a Kubeflow PyTorchJob pod; ``srun`` with one task per node): dtrain
    then starts the elastic agent for that node with the given node rank and master.
    """

    source: str  # "torchrun", "Slurm", "PyTorchJob"
    role: str  # "worker" or "node"
    nnodes: str = "1"  # node role: "N", or "MIN:MAX" for an elastic job
    node_rank: int | None = None
    endpoint: str | None = None  # node role: HOST:PORT of the rendezvous
    rdzv_backend: str = "static"
    rdzv_id: str | None = None
    nproc_per_node: int | None = None
    job_id: str | None = None
    # worker role (Slurm): the slot's place in the job
    worker: DistEnv | None = None

    def worker_env(self) -> DistEnv:
        return self.worker if self.worker is not None else DistEnv()


def read_cluster_env(environ: Mapping[str, str] | None = None) -> ClusterEnv | None:
    """Recognise torchrun, Slurm (inside ``srun``) and Kubeflow PyTorchJob; None outside all three.

    Checked in this order, because they nest: torchrun's workers inside a PyTorchJob pod or a Slurm
    step are torchrun workers first.
    """
    env = os.environ if environ is None else environ
    try:
        if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
            return ClusterEnv("torchrun", "worker", job_id=env.get("TORCHELASTIC_RUN_ID"))
        if "PET_NNODES" in env:
            return _pytorchjob_env(env)
        if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
            return _slurm_env(env)
    except (ValueError, IndexError) as exc:
        raise UserError(f"malformed cluster launcher environment: {exc}; check the job's RANK/SLURM_*/PET_* "
                        "variables") from None
    return None


def _pytorchjob_env(env: Mapping[str, str]) -> ClusterEnv:
    # The Kubeflow training operator (v1 PyTorchJob) sets PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE,
    # MASTER_ADDR/PORT (static), or PET_RDZV_ENDPOINT/BACKEND/ID with PET_NNODES=MIN:MAX (elasticPolicy).
    # Kubeflow Trainer v2 (TrainJob) sets PET_MASTER_ADDR/PORT instead of MASTER_ADDR/PORT.
    nproc = env.get("PET_NPROC_PER_NODE", "")
    common = {"nnodes": env["PET_NNODES"], "nproc_per_node": int(nproc) if nproc.isdigit() else None}
    if env.get("PET_RDZV_ENDPOINT"):
        return ClusterEnv("PyTorchJob", "node", endpoint=env["PET_RDZV_ENDPOINT"],
                          rdzv_backend=env.get("PET_RDZV_BACKEND", "c10d"), rdzv_id=env.get("PET_RDZV_ID"), **common)
    rank = env.get("PET_NODE_RANK", env.get("RANK", "0"))
    kind, endpoint = "PyTorchJob", None
    if "MASTER_ADDR" in env and "MASTER_PORT" in env:
        endpoint = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    elif "PET_MASTER_ADDR" in env and "PET_MASTER_PORT" in env:
        kind, endpoint = "TrainJob", f"{env['PET_MASTER_ADDR']}:{env['PET_MASTER_PORT']}"
    return ClusterEnv(kind, "node", node_rank=int(rank), endpoint=endpoint, **common)


def slurm_master_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT if set, else one derived from the job id, so that every task computes the same port
    and two jobs sharing a node rarely collide."""
    if env.get("MASTER_PORT"):
        return int(env["MASTER_PORT"])
    return 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000


def _slurm_env(env: Mapping[str, str]) -> ClusterEnv:
    ntasks = int(env["SLURM_STEP_NUM_TASKS"])
    nnodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
    master = env.get("MASTER_ADDR") or expand_hostlist(nodelist)[0]
    port = slurm_master_port(env)
    node_id = int(env.get("SLURM_NODEID", "0"))
    if ntasks == nnodes:  # one task per node: each task is a node's agent
        return ClusterEnv("Slurm", "node", nnodes=str(nnodes), node_rank=node_id, endpoint=f"{master}:{port}",
                          job_id=env.get("SLURM_JOB_ID"))
    per_node = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    local_world = per_node[node_id] if node_id < len(per_node) else max(1, ntasks // max(1, nnodes))
    slot = DistEnv(rank=int(env["SLURM_PROCID"]), world_size=ntasks, local_rank=int(env.get("SLURM_LOCALID", "0")),
                   local_world_size=local_world, master_addr=master, master_port=port)
    return ClusterEnv("Slurm", "worker", job_id=env.get("SLURM_JOB_ID"), worker=slot)


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list, e.g. ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1
    (what ``scontrol show hostnames`` prints; parsed here so no Slurm binary is needed)."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", hostlist):
        hosts.extend(_expand_one(item))
    return hosts


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end():]
    out = []
    for part in match.group(1).split(","):
        lo, _, hi = part.partition("-")
        if hi:
            out.extend(f"{head}{n:0{len(lo)}d}{t}" for n in range(int(lo), int(hi) + 1) for t in _expand_one(tail))
        else:
            out.extend(f"{head}{lo}{t}" for t in _expand_one(tail))
    return out


def expand_tasks_per_node(spec: str) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1] (Slurm's SLURM_TASKS_PER_NODE format)."""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"cannot parse tasks per node {spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
