"""Metric reduction across slots and the run's metric sinks (metrics.jsonl, TensorBoard).

Reductions pack every metric of a report into one tensor so that a report costs one all-reduce,
whatever the number of metrics; the trainer's reports launch it and read it one step later
(:class:`SumInFlight`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain import dist as ddist
from dtrain.errors import UserError


def _checked(name: str, value: Any) -> torch.Tensor | float:
    """A metric as a 0-d tensor (left on its device: no host sync) or a float; UserError otherwise."""
    if isinstance(value, torch.Tensor):
        if value.is_cpu:
            # Already in host memory: reading it waits for nothing, and a Python float sum costs less than
            # a tensor kernel per metric per step (the same float64 sum either way). ``item()`` here is no
            # device sync; it is the cheapest read (cheaper than ``float(value.detach())``),
            # and it checks the size itself (one element, or RuntimeError: the error below).
            try:  # a try costs nothing when nothing is raised; a suppress() context is an object per call
                return float(value.item())
            except RuntimeError:
                pass  # more than one element: the error below
        elif value.numel() == 1:  # shape is host-side metadata: checking it does not sync
            return value.detach().reshape(())
        raise UserError(f"metric {name!r} is a tensor of shape {tuple(value.shape)}; return a scalar")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise UserError(f"metric {name!r} is a {type(value).__name__}; return a number or a scalar tensor")


def checked_metrics(metrics: Mapping[str, Any]) -> dict[str, torch.Tensor | float]:
    """A step's metrics checked once (see :func:`_checked`), for both the non-finite watch and the
    accumulator: the trainer reads a CPU loss on the host once per step, not once per consumer."""
    if type(metrics) is not dict and not isinstance(metrics, Mapping):  # the ABC check only when not a dict
        if isinstance(metrics, torch.Tensor):  # a bare loss, as Determined's train_batch may return
            return {"loss": _checked("loss", metrics)}
        raise UserError(f"train_batch returned a {type(metrics).__name__}; return a dict of scalar metrics, "
                        "e.g. {'loss': loss}")
    return {name: _checked(name, value) for name, value in metrics.items()}


class MeanAccumulator:
    """Weighted running sums of scalar metrics: ``sum(value * weight)`` and ``sum(weight)`` per key.

    Tensor metrics on an accelerator are summed on their own device, in float64, in place: adding one costs
    no host sync and, after the first step of a report window, no allocation (CPU tensors are read at
    once). They become Python floats only when a report reads them (:meth:`local_means`,
    :meth:`global_means`, :meth:`state_dict`).
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor | float] = {}
        self.weight = 0.0

    def add(self, metrics: Mapping[str, Any], weight: float = 1.0) -> None:
        self.add_checked(checked_metrics(metrics), weight)

    def add_checked(self, metrics: Mapping[str, torch.Tensor | float], weight: float = 1.0) -> None:
        """:meth:`add` for metrics already through :func:`checked_metrics`."""
        sums = self.sums
        for name, value in metrics.items():
            total = sums.get(name)
            # The usual CPU case after the first step, without the isinstance checks below: this runs every
            # step, and bench/loop_cost.py shows the difference.
            if type(value) is float and type(total) is float:
                sums[name] = total + value * weight
                continue
            if isinstance(value, torch.Tensor):
                if not isinstance(total, torch.Tensor):
                    total = torch.full((), float(total or 0.0), dtype=torch.float64, device=value.device)
                    self.sums[name] = total
                total.add_(value, alpha=weight)
            elif isinstance(total, torch.Tensor):
                total.add_(value * weight)
            else:
                self.sums[name] = (total or 0.0) + value * weight
        self.weight += weight

    def _floats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.sums.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self._floats(), "weight": self.weight}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sums = {k: float(v) for k, v in state["sums"].items()}
        self.weight = float(state["weight"])

    def reset(self) -> None:
        self.sums = {}
        self.weight = 0.0

    def local_means(self) -> dict[str, float]:
        return {k: v / self.weight for k, v in sorted(self._floats().items())} if self.weight else {}

    def global_means(self, group: Any = None) -> dict[str, float]:
        """Exact means over every slot's records: sums and weights are added, then divided once.

        This is a collective: every rank must call it. A key count travels with the sums so that ranks
        reporting different metric names fail loudly instead of mixing numbers up.
        """
        if not ddist.is_distributed(group):
            return self.local_means()
        names, values = self.packed()
        inflight = SumInFlight(values, group)
        return means_of(names, inflight.wait(), inflight.world)

    def packed(self) -> tuple[list[str], list[torch.Tensor | float]]:
        """The metric names (sorted) and ``[name count, weight, sum per name]``, to be summed over ranks
        (by :class:`SumInFlight`) and read back by :func:`means_of`."""
        names = sorted(self.sums)
        return names, [float(len(names)), self.weight, *(self.sums[n] for n in names)]


def means_of(names: list[str], summed: list[float], world: int) -> dict[str, float]:
    """The global means from :meth:`MeanAccumulator.packed` summed over ``world`` ranks (its first
    ``len(names) + 2`` values; what follows belongs to the caller)."""
    if summed[0] != len(names) * world:
        raise RuntimeError(f"ranks reported different metric names (this rank: {names}); report the same keys")
    total_weight = summed[1]
    return {n: summed[2 + i] / total_weight for i, n in enumerate(names)} if total_weight else {}


class SumInFlight:
    """An asynchronous all-reduce (sum) of a few scalars, packed into one tensor: one collective
    whatever their number. Launched where they are known, read by :meth:`wait` where they are needed,
    so that the loop goes on meanwhile instead of waiting for the slowest rank (the trainer's reports).
    Without a process group of more than one rank, the values are this rank's own."""

    __slots__ = ("_packed", "_work", "world")

    def __init__(self, values: list[torch.Tensor | float], group: Any = None) -> None:
        self.world = ddist.world_size(group)  # the ranks summed over
        distributed = self.world > 1
        # NCCL reduces CUDA tensors only; Gloo (and one process) takes them on the host.
        cuda = distributed and dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self._packed = torch.cat([torch.as_tensor(v, dtype=torch.float64).to(device).reshape(1) for v in values])
        self._work = dist.all_reduce(self._packed, group=group, async_op=True) if distributed else None

    def wait(self) -> list[float]:
        """The sums over every rank (blocks until the all-reduce is done; at once if it already is)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._packed.cpu().tolist()


class MetricsWriter:
    """Chief-only sink: one JSON object per report in ``metrics.jsonl`` plus TensorBoard scalars."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        self._tb = EventFile(run_dir / "tensorboard")

    def write(self, kind: str, batches: int, epoch: int, metrics: Mapping[str, float], **extra: Any) -> None:
        record = {"kind": kind, "batches": batches, "epoch": epoch, "metrics": _finite(metrics), **extra}
        self._file.write(json.dumps(record) + "\n")
        self.scalars(kind, metrics, batches)

    def scalars(self, prefix: str, values: Mapping[str, float], batches: int) -> None:
        """TensorBoard only (e.g. the step-time breakdown): tags ``prefix/name``."""
        self._tb.scalars({f"{prefix}/{name}": value for name, value in values.items()}, batches)

    def close(self) -> None:
        self._file.close()
        self._tb.close()


_FILES = itertools.count()


class EventFile:
    """A TensorBoard event file written in the calling thread, a report's scalars as one event.

    Why not ``SummaryWriter.add_scalar``: every call hands one event to the event writer's thread, which
    wakes, takes the GIL from the training loop and computes a pure-Python CRC, scalar by scalar
    (docs/benchmarks.md, "What the Trial's extra cost is made of"). Written here, with TensorBoard's own
    record framing and protos, a report costs one serialization and one CRC in line, and is flushed at
    once (visible to a live TensorBoard, and kept if the run dies).
    """

    def __init__(self, folder: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2  # heavy imports, chief only
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        folder.mkdir(parents=True, exist_ok=True)
        # TensorBoard's own naming: it finds event files by the "tfevents" in their names.
        # The counter keeps two writers of one process in one second apart (in-process runs, searches).
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILES)}"
        self._records = RecordWriter(open(folder / name, "wb"))  # noqa: SIM115 (closed by close())
        self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """One event holding every ``tag: value`` (TensorBoard reads each tag as its own series)."""
        if not values:
            return
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))
                                       for tag, value in values.items()])
        self._write(self._event(wall_time=time.time(), step=step, summary=summary))

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())
        self._records.flush()

    def close(self) -> None:
        self._records.close()


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


def membership_records(run_dir: Path) -> list[dict[str, Any]]:
    """The elastic job's membership changes, in order, from the run's ``metrics.jsonl`` (``kind:
    membership`` lines, written by the launcher: dtrain.launcher.membership), without their ``kind``."""
    path = run_dir / "metrics.jsonl"
    found = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("kind") == "membership":
                found.append({k: v for k, v in record.items() if k != "kind"})
    return found
