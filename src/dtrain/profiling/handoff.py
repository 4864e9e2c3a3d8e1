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
nothing across an epoch's end: each epoch starts by waiting for a whole batch's load). The same steps, timed
with the run's own loader setting, ran 10-20% faster than the run's on the 2-core VM (its timers, the cores'
state after it): the run's own count is timed too, first and last, and the doctor takes the ratios.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import signal
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from dtrain import dist as ddist

log = logging.getLogger(__name__)

# Batches timed after the first (which pays for the worker's start), fewer where the budget runs out first.
BATCHES, BUDGET_SECONDS = 12, 0.5
# A batch the loader processes take longer than this to hand over ends the probe (torch raises), rather than the
# run. The probed data loads a batch in place in MAX_LOAD_SECONDS or less, so a wait this long is a loader process
# that cannot deliver (seen once in the suite: neither rank's first batch came). It stays far below the collective
# timeout (30 s in the tests): a peer whose batch came waits in the step's exchange meanwhile, and a 30 s wait
# here once timed that exchange out and failed a run that had trained.
TIMEOUT_SECONDS = 5.0
# Data slower than this to load in place is not probed: the probe would cost two such batches and more, and
# the handoff is small beside such a load (the loader plan then takes the in-place load for both).
MAX_LOAD_SECONDS = 0.25
# Loader processes per slot probed at most (beyond what would hide the load); the steps timed with each (as many
# as fit in a share of the budget, within bounds); all of it within a budget the ranks agree on, the probe a small
# cost beside a run. Before the timed steps, the batches the loader processes queued while they started
# (PREFETCH each) are taken: a step on a queued batch does not wait for its loading.
MAX_WORKERS, PREFETCH, CROWDED_BUDGET_SECONDS = 8, 2, 2.0
MIN_CROWDED_STEPS, MAX_CROWDED_STEPS, STARTS_TIMED = 8, 40, 3


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
    batches = _Batches(_through_processes(loader, per_slot, BATCHES + 1, workers=1))
    walls: list[float] = []
    cpu = 0.0
    try:
        next(batches)  # the worker's start, and its first batches queued ahead
        deadline = time.perf_counter() + BUDGET_SECONDS
        for _ in range(BATCHES):
            start, start_cpu = time.perf_counter(), time.thread_time()
            next(batches)
            walls.append(time.perf_counter() - start)
            cpu += time.thread_time() - start_cpu
            if time.perf_counter() > deadline:
                break
    except Exception:
        batches.close(failed=True)
        raise
    batches.close()
    return {"probe_handoff": statistics.median(walls), "probe_handoff_cpu": cpu / len(walls)}


class _Batches:
    """A probe loader's batches, epoch after epoch, through its loader processes, which :meth:`close` ends."""

    __slots__ = ("_before", "_iterator", "_loader", "_threads")

    def __init__(self, loader: DataLoader[object]) -> None:
        self._before = {child.pid for child in multiprocessing.active_children()}  # the run's own loader processes
        self._threads = set(threading.enumerate())
        self._loader: DataLoader[object] | None = loader
        self._iterator: Iterator[object] | None = iter(loader)

    def __next__(self) -> object:
        if self._loader is None or self._iterator is None:
            raise StopIteration
        try:
            return next(self._iterator)
        except StopIteration:  # the next epoch
            self._iterator = iter(self._loader)
            return next(self._iterator)

    def close(self, failed: bool = False) -> None:
        """End the loader processes. ``failed`` (one did not deliver in time): killed first, not only asked to
        stop, since torch's iterator then waits up to 5 s for each that does not answer, in turn, with the run's
        peers waiting meanwhile. torch's SIGCHLD handler raises here for a loader process killed by a signal until
        its iterator forgets it (as the iterator ends), so the handler is set aside until then (possible in the
        main thread only, where the probes run; elsewhere the processes are asked to stop)."""
        previous = signal.getsignal(signal.SIGCHLD)
        if failed and previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                for child in multiprocessing.active_children():
                    if child.pid not in self._before:
                        child.kill()
                        child.join(timeout=1.0)  # (a process in uninterruptible sleep may outlive SIGKILL a while)
                self._iterator = self._loader = None  # the processes' pipes closed and their pids forgotten
            finally:
                signal.signal(signal.SIGCHLD, previous)
        self._iterator = self._loader = None
        self._join_threads()

    def _join_threads(self) -> None:
        """Wait (a second at most) for the threads the loader started to end: its queues' feeder threads end
        after the loader, on their own. A thread ending while the next loader forks its processes can leave a
        child stuck for good before its first line: CPython 3.11 reclaims the parent's other threads in the
        child under a lock that an ending thread may have held at the fork (seen: the crowded probe's loader
        processes, their first batch never came; a debugger showed each left child in PyOS_AfterFork_Child, in
        _PyThreadState_DeleteExcept, waiting for the runtime's head lock)."""
        deadline = time.monotonic() + 1.0
        for thread in threading.enumerate():
            if thread not in self._threads and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


@dataclass(frozen=True, slots=True)
class Pace:
    """What the run's steps take, which sizes the crowded probe: ``rest`` (the step without its data wait),
    ``load`` (a batch loaded in place) and ``through`` (a batch through one loader process, on idle cores)."""

    rest: float
    load: float
    through: float

    def step(self, workers: int) -> float:
        """A step's seconds with ``workers`` loader processes per slot, as idle cores would give it."""
        return self.rest + self.load if workers == 0 else max(self.rest, self.through / workers)

    def needed(self) -> int:
        """Loader processes per slot that hide the load behind the rest of the step (at most MAX_WORKERS)."""
        return min(MAX_WORKERS, math.ceil(self.through / self.rest)) if self.through > 0 and self.rest > 0 else 0


@dataclass(frozen=True, slots=True)
class CrowdedSteps:
    """The crowded probe's mean steps: ``own`` with the run's own loader processes per slot (timed first and
    last, the mean of both), ``steps`` with W = 1, 2, ... as far as timed (``own`` among them where it is one),
    and 0 where the run had loader processes."""

    own: float
    steps: dict[int, float]  # 0: each batch loaded in place (timed where the run had loader processes)


def crowded_steps(loader: DataLoader[object], per_slot: int, pace: Pace, own: int, group: object,
                  step: Callable[[object | None], object]) -> CrowdedSteps | None:
    """Mean seconds of a step (the run's samples/s is a mean too) with W loader processes per slot, for W from what
    hides the load on every rank (:meth:`Pace.needed`) down to 1, as far as the budget goes, and with the run's
    own ``own`` (0: loaded in place) timed first and last, the same way: the probe's steps may run faster or
    slower than the run's (the run's timers, the cores' state after it), so the doctor takes their ratios to
    ``own``. A run with loader processes is also timed with none (W = 0), after the others. None where not even
    ``own`` could be timed within the budget.

    Each step takes a batch and gives it to ``step``: the training's work on it (None where this rank's loader
    failed; ``step`` returns False where the batch it was given failed, and trained on one of its own). A
    collective over ``group``: every rank calls it and takes the same number of steps; a rank whose loader fails
    keeps stepping (its peers' exchange waits for it), and then no rank reports a figure for that count."""
    workers = -ddist.least_over_ranks(-pace.needed(), group)
    # The most processes first: the formula holds where few processes crowd the cores, and misses most where many
    # do, which is where the advice looks; a slow load through one process may not fit the budget at all.
    # A run with loader processes is timed without them too (last): loaders of small batches can take more of
    # the shared cores than they hide.
    counts = [w for w in range(workers, 0, -1) if w != own] + ([0] if own else [])
    feeding = Feeding.of(loader)
    shares = _shares(pace, feeding, own, counts)
    timed: dict[int, float] = {}
    spent = 0.0
    opening = _timed_count(loader, per_slot, own, pace, shares[own], feeding, group, step)
    if opening is None:
        return None
    for count in counts:
        # A count whose fewest steps do not fit in its share of what is left ends the probe.
        start = time.perf_counter()
        left = CROWDED_BUDGET_SECONDS - 2 * shares[own] - spent
        seconds = _timed_count(loader, per_slot, count, pace, min(shares.get(count, 0.0), left), feeding, group, step)
        spent += time.perf_counter() - start
        if seconds is None:
            break
        timed[count] = seconds
    closing = _timed_count(loader, per_slot, own, pace, shares[own], feeding, group, step)
    mean = (opening + closing) / 2 if closing is not None else opening
    return CrowdedSteps(mean, {**timed, own: mean} if own else timed)


def _shares(pace: Pace, feeding: Feeding, own: int, counts: list[int]) -> dict[int, float]:
    """Seconds of the budget for each count (``own``'s twice: timed first and last), in proportion to what its
    fewest steps take at the pace idle cores would give: a slow load through one process takes many times what
    it takes through eight, and equal shares left no count of a slow loader timed (its own steps, each batch
    loaded in place, did not fit either). Where even the fewest steps of every count do not fit, the counts in
    ``counts``' order that do (the reference first)."""
    def least(workers: int) -> float:  # and the first batch, the processes' start (a half: int() rounds down)
        return (MIN_CROWDED_STEPS + feeding.warmup(workers) + 0.5) * pace.step(workers) + pace.through * (workers > 0)

    kept, total = [], 2 * least(own)
    for count in counts:
        if total + least(count) > CROWDED_BUDGET_SECONDS:
            break
        kept.append(count)
        total += least(count)
    # Time to spare goes to more steps of each, up to twice the fewest: the counts after them still get theirs.
    slack = min(2.0, CROWDED_BUDGET_SECONDS / total) if total > 0 else 1.0
    return {w: least(w) * slack for w in [own, *kept]}


def _timed_count(loader: DataLoader[object], per_slot: int, workers: int, pace: Pace, share: float,
                 feeding: Feeding, group: object, step: Callable[[object | None], object]) -> float | None:
    """The mean step with ``workers`` loader processes per slot, over as many steps as fit in ``share`` seconds
    (the same on every rank); None where too few fit or a rank's loader failed."""
    fit = int(share / pace.step(workers)) - feeding.warmup(workers)
    steps = ddist.least_over_ranks(feeding.timed(fit), group)
    if steps < MIN_CROWDED_STEPS:
        return None
    seconds = _crowded(loader, per_slot, workers, steps, step, feeding)
    return seconds if ddist.least_over_ranks(int(seconds is not None), group) == 1 else None


@dataclass(frozen=True, slots=True)
class Feeding:
    """How the run's loader feeds its processes, which the crowded probe's loaders copy: ``persistent`` (kept
    across epochs; else each epoch starts them anew, and waits for their first batch), ``prefetch`` (batches
    each queues ahead) and ``epoch`` (batches per epoch on a rank: the same on every rank, the sampler shards
    evenly)."""

    persistent: bool
    prefetch: int
    epoch: int

    @classmethod
    def of(cls, loader: DataLoader[object]) -> Feeding:
        """The run's own (a run without loader processes: torch's defaults for a loader given some)."""
        try:
            epoch = max(1, len(loader))
        except TypeError:  # no length (a stream): its loader fails to start in the probe, which says so
            epoch = 1
        if loader.num_workers == 0:  # the trainer's own default for loader processes: persistent
            return cls(True, PREFETCH, epoch)
        return cls(bool(loader.persistent_workers), loader.prefetch_factor or PREFETCH, epoch)

    def warmup(self, workers: int) -> int:
        """Steps before the timed ones: the queue the loader processes filled while starting, and one more."""
        return self.prefetch * workers + 1

    def timed(self, fit: int) -> int:
        """Steps to time, of the ``fit`` the budget allows: whole epochs where one fits, up to ``STARTS_TIMED`` of
        them or ``MAX_CROWDED_STEPS`` steps, whichever is more; else at most ``MAX_CROWDED_STEPS``. An epoch
        starts with an empty queue (loader processes fetch nothing across its end, and ones not persistent start
        anew), and k epochs' steps in a row hold exactly k starts, wherever they begin."""
        if self.epoch > fit:
            return min(MAX_CROWDED_STEPS, fit)
        epochs = min(fit // self.epoch, max(STARTS_TIMED, MAX_CROWDED_STEPS // self.epoch))
        return epochs * self.epoch


def _crowded(loader: DataLoader[object], per_slot: int, workers: int, timed: int,
             step: Callable[[object | None], object], feeding: Feeding) -> float | None:
    warmup = feeding.warmup(workers)
    batches = _started(loader, per_slot, workers, feeding)
    walls: list[float] = []
    last = time.perf_counter()
    for _ in range(warmup + timed):
        batch = None
        if batches is not None:
            try:
                batch = next(batches)
            except Exception as exc:
                batches.close(failed=True)
                log.info("crowded loader probe stopped: %s", exc)
                batches = None
        # Whatever happened above, the other ranks' steps meet this one's; a taken batch that failed in the step
        # ends this count's figure on this rank as a failed loader does (the step ran on the caller's own batch).
        if step(batch) is False and batches is not None:
            batches.close()
            batches = None
        now = time.perf_counter()
        walls.append(now - last)
        last = now
    if batches is None:
        return None
    batches.close()
    return statistics.fmean(walls[warmup:])


def _started(loader: DataLoader[object], per_slot: int, workers: int, feeding: Feeding) -> _Batches | None:
    """Batches through ``workers`` loader processes fed as the run's are, epoch after epoch of the run's length,
    its first batch taken (the workers' start); None where they cannot start."""
    batches = None
    try:
        with warnings.catch_warnings():  # torch's advice on loader processes per core: crowding them is the point
            warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
            batches = _Batches(_through_processes(loader, per_slot, feeding.epoch, workers, feeding.prefetch,
                                                  persistent_workers=feeding.persistent))
            next(batches)
        return batches
    except Exception as exc:
        if batches is not None:
            batches.close(failed=True)
        log.info("crowded loader probe skipped: %s", exc)
        return None


def _through_processes(loader: DataLoader[object], per_slot: int, batches: int, workers: int,
                       prefetch: int | None = PREFETCH, **options: bool) -> DataLoader[object]:
    """``batches`` batches of the run's data set (its first records, in order) through ``workers`` loader
    processes. Its own generator: the iterator draws its workers' base seed from it, not from the global random
    stream, which the run's next steps would otherwise continue differently."""
    size = len(loader.dataset)  # type: ignore[arg-type]
    indices = [i % size for i in range(batches * per_slot)]
    processes = {"prefetch_factor": prefetch, "timeout": TIMEOUT_SECONDS, **options} if workers else {}
    return DataLoader(loader.dataset, batch_size=per_slot, sampler=indices, num_workers=workers,
                      collate_fn=loader.collate_fn, generator=torch.Generator().manual_seed(0), **processes)
