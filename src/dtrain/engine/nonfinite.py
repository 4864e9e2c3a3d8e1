"""Non-finite losses and gradients (``optimizations.on_nonfinite``), seen alike on every rank.

``fail`` (the default) costs no host sync per step: each rank keeps, on its device, the first batch where
its loss was not finite (:class:`NonFiniteWatch`, a few tiny kernels per step; none for a CPU loss, read as
a float). The ranks compare those where the loop syncs anyway: at each report, a "seen one" flag travels
in the report's own all-reduce, and only when it is set does a second all-reduce (MIN) find the first rank
and batch; before each checkpoint, that MIN at once, so a checkpoint with non-finite weights is never
written. The error names the first rank and batch.

``skip`` must decide at the very step, identically on every rank, whether to apply the update: the
gradients' norm is checked after they were exchanged. Where the strategy leaves them identical on every
rank (DDP, all-reduce) the local check is the global one; otherwise (FSDP's shards, local SGD's local
gradients) a one-element all-reduce agrees on it. Reading the flag costs one host read per optimizer
step: free on CPU, a sync on GPU. After ``max_nonfinite_skips`` skipped steps in a row, the run fails.
A parameter server's servers already drop non-finite gradients themselves; 16-mixed has its loss scaler.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from dtrain import dist as ddist

NEVER = 2**40  # "no non-finite loss yet", as a batch index; times the world size it still fits in int64


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or gradient; ``rank`` is the rank where it first appeared."""

    def __init__(self, message: str, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


def _watched(metrics: Any) -> Any:
    """The value to watch: ``loss`` when the trial reports one, else its first metric."""
    if type(metrics) is dict and "loss" in metrics:
        return metrics["loss"]
    if not isinstance(metrics, dict) or not metrics:
        return None
    return metrics[sorted(metrics)[0]]


class NonFiniteWatch:
    """This rank's first batch with a non-finite loss, kept on the device until the ranks compare."""

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.group = group
        self.device = device
        # Device values (GPU): float64 holds every batch index and NEVER exactly; the buffers live on the
        # watched value's device and are reused, so a step costs four tiny kernels, no sync, no allocation.
        self._first: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._never: torch.Tensor | None = None
        self._host_first = NEVER  # for values on the host: Python floats and CPU tensors

    def observe(self, metrics: Any, batch: int) -> None:
        value = _watched(metrics)
        if type(value) is float:  # the usual case on CPU (a loss read by metrics.checked_metrics): checked first
            if not math.isfinite(value) and self._host_first == NEVER:
                self._host_first = batch
            return
        if isinstance(value, torch.Tensor) and value.is_cpu:
            # A CPU tensor's value is already in host memory: reading it waits for no device, and costs far
            # less than launching the four kernels below every step, which shows on small models.
            value = value.item()  # no device to wait for
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if self._first is None or self._first.device != value.device:
                self._first = torch.full((), float(NEVER), dtype=torch.float64, device=value.device)
                self._never = self._first.clone()
                self._scratch = torch.zeros((), dtype=torch.float64, device=value.device)
            scratch = self._scratch
            assert scratch is not None and self._never is not None
            torch.sub(value.reshape(()), value.reshape(()), out=scratch)  # 0 when finite, nan otherwise
            torch.nan_to_num(scratch, nan=1.0, out=scratch)  # 0 or 1
            torch.add(self._never, scratch, alpha=batch - NEVER, out=scratch)  # NEVER, or this batch
            torch.minimum(self._first, scratch, out=self._first)
        elif isinstance(value, (int, float)) and not math.isfinite(value) and self._host_first == NEVER:
            self._host_first = batch

    def seen(self) -> torch.Tensor | float:
        """1 if this rank saw a non-finite loss, else 0; on the watched value's device (no sync). Summed
        over the ranks with a report's metrics: only when the sum is not 0 does :meth:`first` ask which."""
        seen = float(self._host_first != NEVER)
        if self._first is None:
            return seen
        return (self._first < NEVER).to(torch.float64) + seen

    def first(self) -> tuple[int, int] | None:
        """Collective over the training ranks: (rank, batch) of the first non-finite loss, or None."""
        world = ddist.world_size(self.group)
        rank = ddist.rank(self.group)
        first = int(self._first.item()) if self._first is not None else NEVER  # a sync: reports sync anyway
        key = torch.tensor(min(first, self._host_first) * world + rank, dtype=torch.int64, device=self.device)
        if world > 1:
            dist.all_reduce(key, op=dist.ReduceOp.MIN, group=self.group)
        value = int(key.item())
        return None if value >= NEVER * world else (value % world, value // world)

    def fail_if_any(self, now: int, when: str) -> None:
        """Collective: raise :class:`NonFiniteError` on every rank if any rank saw a non-finite loss."""
        found = self.first()
        if found is not None:
            rank, batch = found
            raise NonFiniteError(f"the loss became non-finite (nan or inf) on rank {rank} at batch {batch}; "
                                 f"stopped {when} at batch {now}, so no checkpoint holds non-finite weights "
                                 "(optimizations.on_nonfinite: fail); lower the learning rate, clip gradients, or "
                                 "set optimizations.on_nonfinite: skip", rank)


def gradients_nonfinite(optimizer: torch.optim.Optimizer, group: Any, replicated: bool,
                        device: torch.device) -> bool:
    """Whether any gradient of ``optimizer`` is nan/inf on any rank (``replicated``: the gradients are
    identical on every rank already, so no communication is needed)."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    # Sharded strategies hold DTensors: this rank's shard is what it can check (the all-reduce does the rest).
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if local:  # one fused pass over the gradients: a sum of norms is finite iff every element is
        norms = torch._foreach_norm(local)
        found = (~torch.isfinite(torch.stack([n.to(device) for n in norms]).sum())).to(torch.float32).reshape(1)
    else:
        found = torch.zeros(1, device=device)
    if not replicated and ddist.is_distributed(group):
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item())
