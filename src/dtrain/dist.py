"""Everything about the process group.

Workers are started by torch's elastic agent (``torch.distributed.run``), which exports RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT and TORCHELASTIC_RESTART_COUNT. A plain ``python script.py`` with none of
them is a world of one. Those variables, and Slurm's and Kubeflow's, are read by :mod:`dtrain.launchenv`
(without torch) and re-exported here.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from dtrain.errors import UserError

# Read before torch is imported (dtrain run), so kept apart; re-exported here, where most of dtrain imports them.
from dtrain.launchenv import (  # noqa: F401
    ClusterEnv,
    DistEnv,
    expand_hostlist,
    expand_tasks_per_node,
    read_cluster_env,
    read_env,
    slurm_master_port,
)

log = logging.getLogger(__name__)


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def bound_per_task(local_slots: int, gpus: int, environ: Mapping[str, str] | None = None) -> bool:
    """Whether Slurm gave each task a GPU of its own (``srun`` with one task per slot and
    ``--gpus-per-task=1``/``--gpu-bind``): this process is one slot, started by Slurm itself (not by
    torchrun or dtrain's agent, whose workers all inherit one environment), and sees exactly one device,
    named by ``CUDA_VISIBLE_DEVICES``. Each rank then uses its one ``cuda:0``."""
    env = os.environ if environ is None else environ
    named = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not (local_slots > 1 and gpus == 1 and len(named) == 1) or "RANK" in env:
        return False
    cluster = read_cluster_env(env)
    return cluster is not None and cluster.source == "Slurm" and cluster.role == "worker"


def gpus_for(local_slots: int, environ: Mapping[str, str] | None = None) -> int:
    """GPUs the ``local_slots`` of this machine have among them: the visible ones, or one each where the
    scheduler bound a GPU to each task (:func:`bound_per_task`)."""
    gpus = _visible_gpus()
    return local_slots if bound_per_task(local_slots, gpus, environ) else gpus


def resolve_backend(requested: str, local_slots: int = 1, warn: bool = True) -> str:
    """``auto``: NCCL when this machine has a GPU for each of its ``local_slots``, else Gloo on CPU (with
    a warning when GPUs are visible but too few, so a 2-slot run on a 1-GPU machine still runs)."""
    gpus = gpus_for(local_slots)
    if requested == "auto":
        if warn and gpus and local_slots > gpus:
            log.warning("backend auto: %d slot(s) on this machine but %d GPU(s): training on CPU with Gloo; use "
                        "--slots %d (or fewer) to train on the GPUs", local_slots, gpus, gpus)
        return "nccl" if gpus >= local_slots and gpus else "gloo"
    if requested == "nccl" and not gpus:
        raise UserError("backend 'nccl' needs CUDA GPUs and none is visible; use backend: gloo (or auto)")
    return requested


def device_for(backend: str, env: DistEnv) -> torch.device:
    """This rank's device: ``cuda:<local rank>`` where the machine's GPUs are all visible to each rank,
    the one visible GPU where each task was given its own (:func:`bound_per_task`), else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    gpus = _visible_gpus()
    if gpus and env.local_rank >= gpus:
        if not bound_per_task(env.local_world_size, gpus):
            raise UserError(f"local rank {env.local_rank} needs a GPU of its own but {gpus} are visible to it; run "
                            f"at most {gpus} slot(s) per machine, or backend: gloo")
        log.info("local rank %d: the scheduler gave this task its own GPU (CUDA_VISIBLE_DEVICES=%s): using cuda:0",
                 env.local_rank, os.environ.get("CUDA_VISIBLE_DEVICES"))
        return torch.device("cuda", 0)
    return torch.device("cuda", env.local_rank)


def limit_cpu_threads(env: DistEnv, environ: Mapping[str, str] | None = None) -> int:
    """CPU threads for this worker: ``OMP_NUM_THREADS`` when set (by the user, ``dtrain run``'s launcher
    or torchrun, which all set it per worker), else the machine's cores shared by its workers. N workers x
    M threads must not exceed the cores, or they fight over them and every collective waits for the
    slowest."""
    env_vars = os.environ if environ is None else environ
    requested = env_vars.get("OMP_NUM_THREADS", "")
    if requested.isdigit() and int(requested) > 0:
        threads = int(requested)
    else:
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
    if backend == "nccl":  # before the early return: code that asks current_device() must get this rank's GPU
        torch.cuda.set_device(device_for(backend, env))
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_seconds)
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
            # `dtrain run` under srun (no agent) already serves this port from the chief for its run-dir
            # handshake (runs.py); multi-tenant stores in one process share that server.
            multi_tenant=True,
        )
        store = dist.PrefixStore(f"dtrain/attempt_{env.restart_count}", tcp)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)


def hold_port(port: int = 0) -> socket.socket | None:
    """A socket bound to ``port`` (0: one the kernel picks) on every address with SO_REUSEADDR, never listening.

    A store's port chosen in one process and served seconds later by another (after it started Python and
    torch) is free for anyone meanwhile: any connection made on the machine may take it as its ephemeral
    port, and the store then fails to listen (EADDRINUSE). While this socket holds it, the kernel hands it
    to no connect() and no bind(port 0), yet a TCPStore server, which binds with SO_REUSEADDR too (libuv),
    may take it. None when ``port`` is taken already (the store then says so when it starts).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", port))
    except OSError:
        sock.close()
        return None
    return sock


def yield_to_pending_destructors() -> None:
    """Release the GIL briefly, so that Gloo's worker threads finish destroying the collectives they ran.

    They destroy finished collectives themselves, and one that holds Python state (tensors made in Python,
    all_gather_object, a barrier's saved thread state) needs the GIL for that. If the group's last reference
    goes away while this thread holds the GIL (a DDP Reducer freed after destroy_process_group, by the garbage
    collector), the group's destructor joins those threads and both wait forever; seen at the end of runs
    across machines. Call it before anything that may free a process group."""
    time.sleep(0.05)


def destroy_process_group() -> None:
    if dist.is_initialized():
        yield_to_pending_destructors()
        dist.destroy_process_group()


def world_size(group: Any = None) -> int:
    """Ranks in ``group`` (the whole job by default); 1 where no process group was made."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the whole job by default); 0 where no process group was made."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def is_distributed(group: Any = None) -> bool:
    """Whether ``group`` has other ranks to talk to: the one test before any collective."""
    return world_size(group) > 1


def least_over_ranks(value: int, group: Any = None) -> int:
    """The smallest ``value`` over ``group``'s ranks (a collective; ``value`` itself where no other rank):
    what every rank must agree on before collectives that only some ranks would otherwise make."""
    if not is_distributed(group):
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    found = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MIN, group=group)
    return int(found.item())


def all_hostnames() -> list[str]:
    """Every rank's host name, in rank order (to name the machine of a straggler)."""
    name = socket.gethostname()
    if not is_distributed():
        return [name]
    names: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(names, name)
    return names


def barrier() -> None:
    if is_distributed():
        dist.barrier()


