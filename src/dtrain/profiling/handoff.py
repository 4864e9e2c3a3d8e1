"""What a batch costs when a loader process makes it: probed at the end of a run, for the doctor's loader advice.

A DataLoader worker reads and collates a batch in its own process, then hands it over: its tensors move to
shared memory, their handles are pickled through a pipe, and the training process unpickles and maps them.
For a small batch that handoff costs more than loading it in place (digits' 64 records: about 1.4 ms a batch
through a worker against 0.3 ms in place, on the 2-core VM of docs/benchmarks.md), so a loader process can
halve a cheap loader's run, and only a measurement says which side wins. The in-place load is probed beside
it (:mod:`dtrain.profiling.probes`); this probe times the same data set through one worker process, with the
training process only taking batches: seconds per batch (the worker's pace) and this thread's CPU seconds per
batch (what receiving one costs the training process).
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
from torch.utils.data import DataLoader

log = logging.getLogger(__name__)

# Batches timed after the first (which pays for the worker's start), fewer where the budget runs out first.
BATCHES, BUDGET_SECONDS = 12, 0.5
# A batch the worker takes longer than this to hand over ends the probe (torch raises), rather than the run.
TIMEOUT_SECONDS = 30.0
# Data slower than this to load in place is not probed: the probe would cost two such batches and more, and
# the handoff is small beside such a load (the loader plan then takes the in-place load for both).
MAX_LOAD_SECONDS = 0.25


def on_host(batch: object) -> bool:
    """Whether every tensor of ``batch`` is in host memory: a loader process (forked) cannot touch CUDA ones."""
    if isinstance(batch, torch.Tensor):
        return batch.device.type == "cpu"
    if isinstance(batch, (list, tuple)):
        return all(on_host(b) for b in batch)
    if isinstance(batch, dict):
        return all(on_host(b) for b in batch.values())
    return True


def handoff_figures(loader: DataLoader[object], per_slot: int) -> dict[str, float]:
    """``probe_handoff`` (median seconds per batch through one loader process) and ``probe_handoff_cpu``
    (this thread's CPU seconds per batch to receive one); empty where the probe could not run."""
    try:
        return _probe(loader, per_slot)
    except Exception as exc:  # a data set that cannot go to a worker process: no figure, said in the log
        log.info("loader handoff probe skipped: %s", exc)
        return {}


def _probe(loader: DataLoader[object], per_slot: int) -> dict[str, float]:
    size = len(loader.dataset)  # type: ignore[arg-type]
    indices = [i % size for i in range((BATCHES + 1) * per_slot)]
    # Its own generator: the loader's iterator draws its workers' base seed from it, not from the global
    # random stream, which the run's next steps would otherwise continue differently.
    probe = DataLoader(loader.dataset, batch_size=per_slot, sampler=indices, num_workers=1,
                       collate_fn=loader.collate_fn, prefetch_factor=2, generator=torch.Generator().manual_seed(0),
                       timeout=TIMEOUT_SECONDS)
    walls: list[float] = []
    cpu = 0.0
    batches = iter(probe)
    next(batches)  # the worker's start, and its first batches queued ahead
    deadline = time.perf_counter() + BUDGET_SECONDS
    for _ in range(BATCHES):
        start, start_cpu = time.perf_counter(), time.thread_time()
        next(batches)
        walls.append(time.perf_counter() - start)
        cpu += time.thread_time() - start_cpu
        if time.perf_counter() > deadline:
            break
    del batches  # the worker process ends with its iterator
    return {"probe_handoff": statistics.median(walls), "probe_handoff_cpu": cpu / len(walls)}
