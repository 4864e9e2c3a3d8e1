"""Roll call before a collective checkpoint: fail in seconds when a rank went on without calling it.

``ctx.save_checkpoint`` is collective (FSDP gathers shards, every rank writes its RNG streams, barriers
commit the folder). The pattern of the DDP tutorials, ``if rank == 0: save()``, then leaves rank 0 in a
barrier that the other ranks never reach: a hang until the collective timeout (5 minutes by default,
torch's own is 30), then an opaque Gloo error.

Each rank therefore publishes a small progress record on the process group's key-value store: how many
saves it has entered, the newest training epoch it has started (from the training loaders' samplers) and
whether it has closed. A rank entering its n-th save counts arrivals; while it waits it reads the others'
records. A rank that has started a *later* epoch, or closed, with fewer than n saves has passed this save
without calling it: ranks train in lockstep (every step all-reduces), so nobody can be an epoch ahead of a
rank that is still waiting unless it skipped the save. That is reported at once, in one line. (A rank
that iterates no training data, such as a parameter server's server, judges by ``close`` alone.) Without such
evidence (a rank still busy, say with a chief-only evaluation) the wait lasts up to the collective timeout,
as any collective would, and then fails naming the absent ranks.
"""

from __future__ import annotations

import json
import time
from typing import Any

from dtrain.errors import UserError

POLL_SECONDS = 0.05
_PREFIX = "dtrain/rollcall"


class SaveMismatchError(UserError):
    """Not every rank called a collective checkpoint save."""


class RollCall:
    """One rank's side of the roll call (a no-op in a world of one or without a store)."""

    def __init__(self, rank: int, world_size: int, timeout_seconds: float, store: Any | None = None) -> None:
        self.rank, self.world_size, self.timeout_seconds = rank, world_size, timeout_seconds
        self.store = store if store is not None else (_default_store() if world_size > 1 else None)
        self.saves = 0
        self.epoch = -1
        self.closed = False

    @property
    def active(self) -> bool:
        return self.store is not None and self.world_size > 1

    def epoch_started(self, epoch: int) -> None:
        """A training loader began iterating ``epoch`` on this rank."""
        if epoch > self.epoch:
            self.epoch = epoch
            self._publish()

    def close(self) -> None:
        """This rank leaves the job: it will never save again."""
        if not self.closed:
            self.closed = True
            self._publish()

    def arrive(self, what: str = "ctx.save_checkpoint") -> None:
        """Enter the next save; return once every rank has entered it, raise :class:`SaveMismatchError`
        as soon as one is known to have passed it (or after the collective timeout)."""
        self.saves += 1
        if not self.active:
            return
        self._publish()
        key = f"{_PREFIX}/save/{self.saves}"
        self.store.add(key, 1)
        deadline = time.monotonic() + self.timeout_seconds
        while self.store.add(key, 0) < self.world_size:
            passed = self._ranks_past(self.saves)
            if passed:
                raise SaveMismatchError(
                    f"{what} is collective, but rank(s) {', '.join(passed)} went on without calling it while "
                    f"rank {self.rank} waited in it; call it on every rank (not under 'if rank == 0': dtrain "
                    "writes the shared files from rank 0 alone)")
            if time.monotonic() > deadline:
                absent = ", ".join(str(r) for r in self._absent(self.saves))
                raise SaveMismatchError(
                    f"{what} is collective, but rank(s) {absent or '?'} did not call it within "
                    f"{self.timeout_seconds:g}s while rank {self.rank} waited; call it on every rank")
            time.sleep(POLL_SECONDS)

    # --------------------------------------------------------------------------------------- store
    def _publish(self) -> None:
        if self.active:
            record = {"saves": self.saves, "epoch": self.epoch, "closed": self.closed}
            self.store.set(f"{_PREFIX}/rank/{self.rank}", json.dumps(record))

    def _record(self, rank: int) -> dict[str, Any] | None:
        key = f"{_PREFIX}/rank/{rank}"
        if not self.store.check([key]):  # get() would block until the key exists
            return None
        return json.loads(self.store.get(key))

    def _ranks_past(self, saves: int) -> list[str]:
        """Ranks with evidence that they went past save number ``saves`` without entering it."""
        passed = []
        for rank in range(self.world_size):
            record = self._record(rank) if rank != self.rank else None
            if record is None or record["saves"] >= saves:
                continue
            if record["closed"]:
                passed.append(f"{rank} (it closed its context)")
            elif self.epoch >= 0 and record["epoch"] > self.epoch:
                # Only a rank that trains itself can tell: a parameter server's servers iterate no data
                # and run behind or ahead of the workers' epochs by design.
                passed.append(f"{rank} (it started epoch {record['epoch']})")
        return passed

    def _absent(self, saves: int) -> list[int]:
        return [r for r in range(self.world_size)
                if r != self.rank and ((rec := self._record(r)) is None or rec["saves"] < saves)]


def _default_store() -> Any | None:
    """The default process group's store (the rendezvous's TCPStore, prefixed per restart attempt)."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not dist.is_initialized():
            return None
        return distributed_c10d._get_default_store()  # private but stable since torch 1.x; no public accessor
    except (ImportError, AttributeError, RuntimeError, ValueError):
        return None
