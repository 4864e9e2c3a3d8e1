"""The tiny trial with faults planted in the end-of-run probes, on one rank: what a GPU user meets (out of memory at
twice the batch) and an exception in each probe's stage (dtrain.profiling.probeguard's stages).

Hyperparameters: ``oom_rank`` (that rank's ``train_batch`` raises ``torch.OutOfMemoryError`` for any batch but the
run's own size, as a GPU whose batch was tuned to fill it does); ``faults`` ({stage: rank}: that rank raises at
that probe stage; the stages are patched in the worker's own modules when the trial is built, which happens before
any probe); ``bad_worker_records_rank`` (that rank's records read in a loader process have the wrong width, so its
``train_batch`` fails on the crowded loader probe's batches, inside a step whose exchange the other rank entered).
"""

from __future__ import annotations

from typing import Any

import torch
from tiny import TinyTrial, synthetic
from torch.utils.data import Dataset, get_worker_info

import dtrain


class _Planted(RuntimeError):
    pass


class _WorkerRecords(Dataset):
    """The tiny trial's records; in a loader process, one feature short."""

    def __init__(self, records: Any) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Any:
        x, y = self.records[index]
        return (x[:-1], y) if get_worker_info() is not None else (x, y)


def _raising(stage: str, rank: int, me: int, original: Any) -> Any:
    def planted(*args: Any, **kwargs: Any) -> Any:
        if me == rank:
            raise _Planted(f"planted fault in {stage}")
        return original(*args, **kwargs)
    return planted


def _plant(faults: dict[str, int], me: int) -> None:
    from dtrain.profiling import commprobe, figures, probes

    # Each stage's own work, as batch_probe calls it (by its module's global name).
    targets = {"data_loading": (probes, "_load_and_handoff"), "batch_scaling": (probes, "_time_work"),
               "solo_probe": (probes, "_solo"), "model_steps": (probes, "_model_steps"),
               "data_crowded": (probes, "_crowd_pace"), "comm_probe": (commprobe, "probe_buffer"),
               "batch_probe": (probes, "restored"), "double_batch": (probes, "double_batch_room"),
               # Not a probe: the end-of-run gather after them, which fails the run (no guard there).
               "gather": (figures, "gather_rank_stats")}
    for stage, rank in faults.items():
        if stage == "restore":
            _plant_restore(rank, me)
            continue
        module, name = targets[stage]
        setattr(module, name, _raising(stage, rank, me, getattr(module, name)))


def _plant_restore(rank: int, me: int) -> None:
    """The saved state's restore fails on ``rank`` (after the probes, before the link probe)."""
    import contextlib

    from dtrain.profiling import probes

    original = probes.restored

    @contextlib.contextmanager
    def restored(*args: Any, **kwargs: Any) -> Any:
        with original(*args, **kwargs):
            yield
        if me == rank:
            raise _Planted("planted fault in restore")

    probes.restored = restored


class ProbeFaultTrial(TinyTrial):
    def __init__(self, context: dtrain.TrialContext) -> None:
        super().__init__(context)
        self.per_slot = context.get_per_slot_batch_size()
        _plant(dict(self.hp.get("faults", {})), context.rank)

    def build_training_data(self) -> Any:
        records = synthetic(self.hp.get("train_size", 256), seed=1)
        return _WorkerRecords(records) if self.hp.get("bad_worker_records_rank") == self.context.rank else records

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        if self.hp.get("oom_rank") == self.context.rank and len(batch[0]) != self.per_slot:
            raise torch.OutOfMemoryError(f"planted: CUDA out of memory at a batch of {len(batch[0])}")
        return super().train_batch(batch, epoch_idx, batch_idx)
