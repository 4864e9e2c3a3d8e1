"""What a batch costs when a loader process makes it: probed at the end of a run, for the doctor's loader advice.

A DataLoader worker reads and collates a batch in its own process, then hands it over: its tensors move to
shared memory, their handles are pickled through a pipe, and the training process unpickles and maps them.
For a small batch that handoff costs more than loading it in place (digits' 64 records: about 1.4 ms a batch
through a worker against 0.3 ms in place, on the 2-core VM of docs/benchmarks.md), so a loader process can
halve a cheap loader's run, and only a measurement says which side wins. The in-place load is probed beside
it (:mod:`dtrain.profiling.probes`); this probe times the same data set through one worker process, with the
training process only taking batches: seconds per batch (the worker's pace) and this thread's CPU seconds per
batch (what receiving one costs the training process).

Those figures come from idle cores. In a run on a CPU host, W loader processes per slot share the cores with the
training: a loader that waits (a file, a sleep) then waits again for a core at every wake-up. On the 2-core VM the
planted slow-data trial (2 slots, 1 ms per record) got a batch every 11 ms from 3 loader processes each, where
their idle pace promised one every 6.8 ms. So on a CPU host every rank also times the step itself with 1, 2, ...
loader processes (:func:`crowded_steps`): after each batch it does the training's work (given by the caller:
:mod:`dtrain.profiling.probes`), and its epochs are as long as the run's (persistent loader processes queue
nothing across an epoch's end: each epoch starts by waiting for a whole batch's load).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader

from dtrain import dist as ddist

log = logging.getLogger(__name__)

# Batches timed after the first (which pays for the worker's start), fewer where the budget runs out first.
BATCHES, BUDGET_SECONDS = 12, 0.5
# A batch the worker takes longer than this to hand over ends the probe (torch raises), rather than the run.
TIMEOUT_SECONDS = 30.0
# Data slower than this to load in place is not probed: the probe would cost two such batches and more, and
# the handoff is small beside such a load (the loader plan then takes the in-place load for both).
MAX_LOAD_SECONDS = 0.25
# Loader processes per slot probed at most (beyond what would hide the load); the steps timed with each (as many
# as fit in a share of the budget, within bounds); all of it within a budget the ranks agree on, the probe a small
# cost beside a run. Before the timed steps, the batches the loader processes queued while they started
# (PREFETCH each) are taken: a step on a queued batch does not wait for its loading.
MAX_WORKERS, PREFETCH, CROWDED_BUDGET_SECONDS = 8, 2, 2.0
MIN_CROWDED_STEPS, MAX_CROWDED_STEPS = 8, 40


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
    probe = _through_processes(loader, per_slot, BATCHES + 1, workers=1)
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


def crowded_steps(loader: DataLoader[object], per_slot: int, rest: float, through: float, group: object,
                  step: Callable[[object | None], object]) -> dict[int, float]:
    """{W: mean seconds of a step with W loader processes (the run's samples/s is a mean too), for W = 1 up to
    what hides the load behind ``rest`` (the run's step without its data wait) on every rank (``through``:
    seconds per batch through one loader process, on idle cores)}. Each step takes a batch and gives it to
    ``step``: the training's work on it (None where this rank's loader failed). A collective over ``group``: every
    rank calls it and takes the same number of steps; a rank whose loader fails keeps stepping (its peers'
    exchange waits for it), and then no rank reports a figure for that count."""
    needed = math.ceil(through / rest) if through > 0 and rest > 0 else 0
    workers = -ddist.least_over_ranks(-min(MAX_WORKERS, needed), group)
    out: dict[int, float] = {}
    spent = 0.0
    for count in range(1, workers + 1):
        # As many steps as fit in this count's share of what is left of the budget (each one the rest of the
        # step, or the loaders' pace where slower); a count whose fewest steps do not fit ends the probe.
        share = min(CROWDED_BUDGET_SECONDS - spent, CROWDED_BUDGET_SECONDS / workers)
        fit = int(share / max(rest, through / count)) - _warmup(count)
        steps = ddist.least_over_ranks(min(MAX_CROWDED_STEPS, fit), group)
        if steps < MIN_CROWDED_STEPS:
            break
        start = time.perf_counter()
        seconds = _crowded(loader, per_slot, count, steps, step)
        spent += time.perf_counter() - start
        if ddist.least_over_ranks(int(seconds is not None), group) == 0:
            break
        out[count] = seconds  # type: ignore[assignment]
    return out


def _crowded(loader: DataLoader[object], per_slot: int, workers: int, timed: int,
             step: Callable[[object | None], object]) -> float | None:
    warmup = _warmup(workers)
    batches = _started(loader, per_slot, workers)
    walls: list[float] = []
    last = time.perf_counter()
    for _ in range(warmup + timed):
        batch = None
        if batches is not None:
            try:
                batch = next(batches)
            except Exception as exc:
                log.info("crowded loader probe stopped: %s", exc)
                batches = None
        step(batch)  # whatever happened above: the other ranks' steps meet this one's
        now = time.perf_counter()
        walls.append(now - last)
        last = now
    measured = batches is not None
    del batches  # the workers end with their iterator
    return statistics.fmean(walls[warmup:]) if measured else None


def _warmup(workers: int) -> int:
    """Steps before the timed ones: the queue the loader processes filled, and one more."""
    return PREFETCH * workers + 1


def _started(loader: DataLoader[object], per_slot: int, workers: int) -> Iterator[object] | None:
    """Batches through ``workers`` persistent loader processes, epoch after epoch of the run's length, its first
    batch taken (the workers' start); None where they cannot start."""
    try:
        epoch = max(1, len(loader))  # the run's batches per epoch on this rank
        with warnings.catch_warnings():  # torch's advice on loader processes per core: crowding them is the point
            warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
            batches = _epochs(_through_processes(loader, per_slot, epoch, workers, persistent_workers=True))
            next(batches)
        return batches
    except Exception as exc:
        log.info("crowded loader probe skipped: %s", exc)
        return None


def _through_processes(loader: DataLoader[object], per_slot: int, batches: int, workers: int,
                       **options: bool) -> DataLoader[object]:
    """``batches`` batches of the run's data set (its first records, in order) through ``workers`` loader
    processes. Its own generator: the iterator draws its workers' base seed from it, not from the global random
    stream, which the run's next steps would otherwise continue differently."""
    size = len(loader.dataset)  # type: ignore[arg-type]
    indices = [i % size for i in range(batches * per_slot)]
    return DataLoader(loader.dataset, batch_size=per_slot, sampler=indices, num_workers=workers,
                      collate_fn=loader.collate_fn, prefetch_factor=PREFETCH,
                      generator=torch.Generator().manual_seed(0), timeout=TIMEOUT_SECONDS, **options)


def _epochs(probe: DataLoader[object]) -> Iterator[object]:
    while True:
        yield from probe
