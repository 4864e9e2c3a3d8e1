"""Everything about the process group. The only module that reads torch's rank/launcher env vars.

Workers are started by torch's elastic agent (``torch.distributed.run``), which exports RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT and TORCHELASTIC_RESTART_COUNT. A plain ``python script.py`` with none of
them is a world of one.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

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


def read_env(environ: dict[str, str] | None = None) -> DistEnv:
    """Read the launcher's variables; absent ones mean a single-process world."""
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
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


def resolve_backend(requested: str) -> str:
    """``auto`` means NCCL when CUDA is present, Gloo otherwise."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise UserError("backend 'nccl' needs CUDA GPUs and none is visible; use backend: gloo (or auto)")
    return requested


def device_for(backend: str, env: DistEnv) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def limit_cpu_threads(env: DistEnv) -> int:
    """Share the cores between the workers of one machine: N workers x M threads must not exceed cores,
    or they fight over cores and every collective waits for the slowest."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, env.local_world_size))
    torch.set_num_threads(threads)
    return threads


def init_process_group(env: DistEnv, backend: str, timeout_seconds: float) -> None:
    """Create the default process group for this attempt.

    After an elastic restart the agent keeps its TCPStore, which still holds the previous attempt's
    Gloo addresses: ranks then connect to dead peers ("connectFullMesh failed ... Connection refused").
    Prefixing every key with the restart count gives each attempt a clean namespace (pytorch#135712).
    """
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if backend == "nccl":  # pragma: no cover - needs a GPU
        torch.cuda.set_device(env.local_rank)
    if not env.launched:
        store: dist.Store = dist.HashStore()
    else:
        tcp = dist.TCPStore(
            env.master_addr,
            env.master_port,
            world_size=None if env.agent_store else env.world_size,
            is_master=env.is_chief and not env.agent_store,
            timeout=timeout,
            wait_for_workers=False,
        )
        store = dist.PrefixStore(f"dtrain/attempt_{env.restart_count}", tcp)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_hostnames() -> list[str]:
    """Every rank's host name, in rank order (to name the machine of a straggler)."""
    name = socket.gethostname()
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [name]
    names: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(names, name)
    return names


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
