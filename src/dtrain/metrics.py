"""Metric reduction across slots and the run's metric sinks (metrics.jsonl, TensorBoard).

Reductions pack every metric of a report into one tensor so that a report costs one all-reduce,
whatever the number of metrics.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain.errors import UserError


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UserError(f"metric {name!r} is a tensor of shape {tuple(value.shape)}; return a scalar")
        return float(value.detach().item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise UserError(f"metric {name!r} is a {type(value).__name__}; return a number or a scalar tensor")


class MeanAccumulator:
    """Weighted running sums of scalar metrics: ``sum(value * weight)`` and ``sum(weight)`` per key."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weight = 0.0

    def add(self, metrics: Mapping[str, Any], weight: float = 1.0) -> None:
        for name, value in metrics.items():
            self.sums[name] = self.sums.get(name, 0.0) + _as_float(name, value) * weight
        self.weight += weight

    def state_dict(self) -> dict[str, Any]:
        return {"sums": dict(self.sums), "weight": self.weight}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sums = dict(state["sums"])
        self.weight = float(state["weight"])

    def reset(self) -> None:
        self.sums.clear()
        self.weight = 0.0

    def local_means(self) -> dict[str, float]:
        return {k: v / self.weight for k, v in sorted(self.sums.items())} if self.weight else {}

    def global_means(self, group: Any = None) -> dict[str, float]:
        """Exact means over every slot's records: sums and weights are added, then divided once.

        This is a collective: every rank must call it. A key count travels with the sums so that ranks
        reporting different metric names fail loudly instead of mixing numbers up.
        """
        if not (dist.is_initialized() and dist.get_world_size(group) > 1):
            return self.local_means()
        names = sorted(self.sums)
        packed = torch.tensor([float(len(names)), self.weight, *(self.sums[n] for n in names)], dtype=torch.float64)
        if dist.get_backend(group) == "nccl":
            packed = packed.cuda()
        dist.all_reduce(packed, group=group)
        packed = packed.cpu()
        world = dist.get_world_size(group)
        if packed[0].item() != len(names) * world:
            raise RuntimeError(f"ranks reported different metric names (this rank: {names}); report the same keys")
        total_weight = packed[1].item()
        return {n: packed[2 + i].item() / total_weight for i, n in enumerate(names)} if total_weight else {}


class MetricsWriter:
    """Chief-only sink: one JSON object per report in ``metrics.jsonl`` plus TensorBoard scalars."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # heavy import, chief only

        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, kind: str, batches: int, epoch: int, metrics: Mapping[str, float], **extra: Any) -> None:
        record = {"kind": kind, "batches": batches, "epoch": epoch, "metrics": _finite(metrics), **extra}
        self._file.write(json.dumps(record) + "\n")
        for name, value in metrics.items():
            self._tb.add_scalar(f"{kind}/{name}", value, global_step=batches)

    def scalars(self, prefix: str, values: Mapping[str, float], batches: int) -> None:
        """TensorBoard only (e.g. the step-time breakdown)."""
        for name, value in values.items():
            self._tb.add_scalar(f"{prefix}/{name}", value, global_step=batches)

    def close(self) -> None:
        self._file.close()
        self._tb.close()


def _finite(metrics: Mapping[str, float]) -> dict[str, float | None]:
    """JSON has no NaN/inf: write them as null rather than producing a file other tools cannot read."""
    return {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}


def truncate_metrics(path: Path, keep_up_to_batches: int) -> None:
    """On resume, drop records past the checkpoint (they are about to be recomputed); keep a backup."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = [ln for ln in lines if ln.strip() and json.loads(ln).get("batches", 0) <= keep_up_to_batches]
    if len(kept) != len([ln for ln in lines if ln.strip()]):
        path.with_name(path.name + ".before-resume").write_text("\n".join(lines) + "\n")
        path.write_text("".join(ln + "\n" for ln in kept))
