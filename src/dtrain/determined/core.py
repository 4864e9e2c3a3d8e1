"""``det.core``: of Determined's Core API only ``DistributedContext`` has a meaning here (where this process
sits in the job); the rest (``core.init`` and its metrics, checkpoint, searcher and preemption contexts)
talks to a Determined master and says so in one line when used. dtrain's own loop API is ``dtrain.init()``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dtrain import dist as ddist
from dtrain.determined._notes import module_getattr, refuse


class DistributedContext:
    """Where this process sits: ``rank``/``size`` over the job, ``local_*`` on this machine, ``cross_*``
    over the machines; and small object collectives over every rank (``broadcast``, ``allgather``,
    ``gather``; pickled, for coordination, not for tensors)."""

    def __init__(self, *, rank: int, size: int, local_rank: int, local_size: int, cross_rank: int,
                 cross_size: int, chief_ip: str | None = None, **_ignored: Any) -> None:
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.cross_rank, self.cross_size = cross_rank, cross_size
        self._chief_ip = chief_ip

    @classmethod
    def from_torch_distributed(cls, chief_ip: str | None = None) -> DistributedContext:
        """From the launcher's environment (``dtrain launch``, ``dtrain run``, torchrun; none: one process)."""
        env = ddist.read_env()
        local = max(1, env.local_world_size)
        return cls(rank=env.rank, size=env.world_size, local_rank=env.local_rank, local_size=local,
                   cross_rank=env.rank // local, cross_size=max(1, env.world_size // local), chief_ip=chief_ip)

    @classmethod
    def from_horovod(cls, hvd: Any, chief_ip: str | None = None) -> DistributedContext:
        refuse("core.DistributedContext.from_horovod", "dtrain trains with torch.distributed only; use "
               "from_torch_distributed() under dtrain launch or torchrun")

    @classmethod
    def from_deepspeed(cls, chief_ip: str | None = None) -> DistributedContext:
        refuse("core.DistributedContext.from_deepspeed", "dtrain trains with torch.distributed (DDP, FSDP, ...); "
               "use from_torch_distributed()")

    def get_rank(self) -> int:
        return self.rank

    def get_size(self) -> int:
        return self.size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_size(self) -> int:
        return self.local_size

    def get_cross_rank(self) -> int:
        return self.cross_rank

    def get_cross_size(self) -> int:
        return self.cross_size

    def get_num_agents(self) -> int:
        return self.cross_size

    def _collective(self) -> bool:
        return self.size > 1 and dist.is_initialized()

    def broadcast(self, stuff: Any = None) -> Any:
        """The chief's ``stuff`` on every rank (every rank calls it)."""
        box = [stuff]
        if self._collective():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def allgather(self, stuff: Any) -> list[Any]:
        """Every rank's ``stuff``, in rank order, on every rank."""
        if not self._collective():
            return [stuff]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, stuff)
        return out

    def gather(self, stuff: Any) -> list[Any] | None:
        """Every rank's ``stuff`` on the chief (in rank order); None on the other ranks."""
        if not self._collective():
            return [stuff]
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(stuff, out, dst=0)
        return out

    def close(self) -> None:
        """Nothing to close: the process group belongs to the context that made it."""


class DummyDistributedContext(DistributedContext):
    """A world of one."""

    def __init__(self) -> None:
        super().__init__(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)


__getattr__ = module_getattr("det.core", {}, default=(
    "Determined's Core API (core.init and its train, checkpoint, searcher and preempt contexts) reports to a "
    "Determined master, and there is none here; write a PyTorchTrial (dtrain run) or your own loop with "
    "dtrain.init() (dtrain launch)"))
