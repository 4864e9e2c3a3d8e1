"""Per-step time breakdown: where does a training step's time go?

Phases of a step, on every rank:

* ``data``         waiting for the next batch (loader + host-to-device copy)
* ``forward``      from the batch to ``context.backward(loss)``
* ``backward``     backward *compute*: until the last gradient is ready
* ``comm_exposed`` the rest of ``backward()``: waiting for gradient all-reduces that did not overlap
* ``optimizer``    ``context.step_optimizer``
* ``other``        everything else in ``train_batch``

A step is a sequence of edges, each saying "the time since the previous edge belongs to phase P". On
CPU an edge is a ``perf_counter`` reading; on CUDA it is an event on the stream
(:mod:`dtrain.profiling.clock`), so no synchronization happens inside a step. Either way a step only
appends its edges to two flat lists; they are resolved in batches by :meth:`StepTimer.flush` (at every
report, and every ``FLUSH_EVERY`` steps at most), which is the only place the profiler waits for the
device, and where the arithmetic of a window's steps is done at once, off the step's path.

Sampling: every step is timed until :data:`DENSE_STEPS` steps are profiled (a short run has them all);
after that, one step in ``sample_every`` on average, drawn at random (geometric gaps from a fixed seed:
every rank times the same steps, and a periodic event such as a report every 100 steps is not always in or
always out of the sample). Each timed step is weighted by the steps it stands for, so the means estimate
those of every profiled step; ``profiled_steps`` counts the steps after the warm-up, ``timed_steps`` those
timed. What sampling saves is less the edges (on CPU, timing every step or one in four made no measurable
difference: docs/benchmarks.md, "What the Trial's extra cost is made of") than what a timed step needs
besides them: on CUDA seven events, and the last-gradient stamp (an event too).
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import torch

from dtrain.profiling.clock import Clock, clock_for
from dtrain.profiling.comm import CommRecorder, union_seconds
from dtrain.profiling.phases import PHASES
from dtrain.profiling.stragglers import STEP_COLUMN, LagSampler

COMM_FIELDS = ("comm_busy", "comm_bytes", "comm_buckets")
_INDEX = {p: i for i, p in enumerate(PHASES)}
_DATA, _FORWARD, _BACKWARD = _INDEX["data"], _INDEX["forward"], _INDEX["backward"]
_EXPOSED, _OTHER = _INDEX["comm_exposed"], _INDEX["other"]
# Steps whose edges are kept before they are resolved (on CUDA, one synchronization per this many steps
# at most, when reports are rarer).
FLUSH_EVERY = 64
# Timed steps per window of the run's drift record (``windows``), and the windows kept (pairs merge beyond).
WINDOW_STEPS = 16
MAX_WINDOWS = 256
# Profiled steps timed one by one before sampling starts; the sampler's seed (the same on every rank).
DENSE_STEPS = 200
SAMPLE_SEED = 20261124


class StepTimer:
    """Accumulates seconds per phase over the steps of a run, on one rank.

    The first ``warmup_steps`` are counted but left out of the phase statistics: they include one-off
    costs (DDP's first-iteration bucket rebuild, allocator warm-up, autotuning kernels). After
    :data:`DENSE_STEPS` profiled steps, one in ``sample_every`` is timed (see the module's doc).
    """

    def __init__(self, device: torch.device, enabled: bool = True, warmup_steps: int = 3, clock: Clock | None = None,
                 sample_every: int = 1) -> None:
        if sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {sample_every}")
        self.enabled = enabled
        self.warmup_steps = warmup_steps
        self.sample_every = sample_every
        self._rng = random.Random(SAMPLE_SEED)
        # log(1 - 1/k): a geometric gap of untimed steps is log(U) / this; 0 means every step is timed.
        self._log_miss = math.log(1.0 - 1.0 / sample_every) if sample_every > 1 else 0.0
        self._skip = 0  # untimed steps before the next timed one
        self._dense_until = warmup_steps + DENSE_STEPS  # steps (warm-up included) timed one by one
        self.clock: Clock = clock if clock is not None else clock_for(device)  # tests script one
        self.recorder = CommRecorder(self.clock)
        self.totals: dict[str, float] = dict.fromkeys(PHASES + COMM_FIELDS, 0.0)
        self.window: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.window_weight = 0
        self.steps = 0  # every step, warm-up included
        self.timed_steps = 0  # profiled steps actually timed
        # Over the timed steps, each weighted by the steps it stands for: their weights, and seconds.
        self.profiled_weight = 0
        self.profiled_seconds = 0.0
        # How steps vary: the weighted sum of squared step times (jitter), and the mean step of each run of
        # WINDOW_STEPS timed steps (drift over the run): the cost model's interval comes from both.
        self.profiled_squares = 0.0
        self.windows: list[float] = []
        self._window_sum, self._window_count = 0.0, 0
        self._last_step = 0.0
        self._in_step = False
        # The host's own seconds fetching each batch, weighted as the steps are: on CUDA the device's clock
        # shows only what the host's fetch left the device idle (nothing while the device is the bound), and
        # the doctor needs the fetch's cost should another precision make the host the bound.
        self._host_began = self._host_data = 0.0
        self.data_host_total = 0.0
        # Whether the current step exchanges gradients (False while aggregating: the context sets it);
        # only exchanging steps are offered to the straggler sampler, as only they have a collective.
        self.exchanging = True
        self.lag = LagSampler()
        # Edges of the steps not resolved yet: phase index (-1 opens a step) and stamp, flat; per step,
        # (first edge, edge count, weight (0: warm-up), comm busy seconds, comm bytes, comm buckets, exchanging?).
        self._phase: list[int] = []
        self._stamp: list[Any] = []
        # CUDA: the collectives' launch and completion events of the pending steps, flat, and per step that
        # had any (its index in _steps, first event, launches, completions): resolved with the edges.
        self._comm_events: list[Any] = []
        self._deferred_busy: list[tuple[int, int, int, int]] = []
        self._steps: list[tuple[int, int, int, float, float, float, bool]] = []
        self._step_first = 0
        # An edge is two appends and a clock read, done in place by its caller (no helper call): a step
        # has seven, and on small CPU steps each Python call shows (bench/step_instructions.py).
        # The lists are only ever cleared in place, so these bound methods stay valid.
        self._add_phase = self._phase.append
        self._add_stamp = self._stamp.append
        self._now = self.clock.stamp

    # ---------------------------------------------------------------------------------- edges
    def _edge(self, phase: int, stamp: Any) -> None:
        self._add_phase(phase)
        self._add_stamp(stamp)

    def start_step(self) -> None:
        if not self.enabled:
            return
        rec = self.recorder
        if rec.grad_ready_seen or rec.launches or rec.completions:  # most CPU steps leave nothing to reset
            rec.reset()
        if self._skip:  # not sampled: counted by end_step, not timed (no edge, no clock read)
            self._skip -= 1
            return
        if self._log_miss and self.steps + 1 >= self._dense_until:
            self._skip = int(math.log(1.0 - self._rng.random()) / self._log_miss)
        self._in_step = True
        rec.armed = True  # this step's last gradient is stamped (untimed steps' hook returns at once)
        self._step_first = len(self._phase)
        self._add_phase(-1)
        self._add_stamp(self._now())
        self._host_began = time.perf_counter()

    def data_lap(self) -> None:
        """The batch is here: the time since the step began was ``data`` (and the host's own seconds of it
        are kept apart, see ``data_host`` in :meth:`per_step`)."""
        if self._in_step:
            self._add_phase(_DATA)
            self._add_stamp(self._now())
            self._host_data = time.perf_counter() - self._host_began

    def lap(self, phase: str) -> None:
        """Charge the time since the previous edge to ``phase``."""
        if self._in_step:  # own loops (dtrain.init) need not mark steps: then nothing is timed
            self._add_phase(_INDEX[phase])
            self._add_stamp(self._now())

    def backward_begin(self) -> None:
        """Before ``loss.backward()``: the time since the previous edge was forward.

        After the last gradient was computed, backward only waits for communication (``comm_exposed``);
        the rest is backward compute (with DDP's own bookkeeping). Begin/end calls rather than a context
        manager: the trainer's step is on the hot path."""
        if self._in_step:
            self._add_phase(_FORWARD)
            self._add_stamp(self._now())
        self.recorder.grad_ready_seen = False

    def backward_end(self) -> None:
        """After ``loss.backward()`` returned."""
        if not self._in_step:
            return
        end = self._now()
        recorder = self.recorder
        if recorder.launches and not self.clock.deferred:
            # Per-bucket stamps (a Python comm hook, CPU): waiting = in-flight time after the last launch.
            start = self._stamp[-1]  # the forward edge: no edge is added while backward runs
            exposed = recorder.busy_seconds(lo=max(start, recorder.launches[-1]), hi=end)
            self._edge(_BACKWARD, end - exposed)
            self._edge(_EXPOSED, end)
        elif recorder.grad_ready_seen:
            self._edge(_BACKWARD, recorder.grad_ready)
            self._edge(_EXPOSED, end)
        else:
            self._edge(_BACKWARD, end)

    def end_step(self) -> None:
        self.steps += 1
        if not self._in_step:  # profiling off, or a step left out of the sample
            return
        self._in_step = False
        self._add_phase(_OTHER)
        self._add_stamp(self._now())
        rec = self.recorder
        rec.armed = False
        if rec.settle is not None:  # DDP says which gradient is ready last from its second step (DDPTiming)
            rec.settle()
        # Weight: how many steps this one stands for (0: warm-up, timed but not in the statistics).
        weight = 0 if self.steps <= self.warmup_steps else 1 if self.steps <= self._dense_until else self.sample_every
        self.data_host_total += self._host_data * weight
        self._host_data = 0.0
        first = self._step_first
        if rec.launches:
            busy = self._defer_busy(rec) if self.clock.deferred else rec.busy_seconds()
            self._steps.append((first, len(self._phase) - first, weight, busy, float(rec.bytes),
                                float(len(rec.launches)), self.exchanging))
        else:  # no timed collective in this step (one slot, DDP's native timers, accumulating steps)
            self._steps.append((first, len(self._phase) - first, weight, 0.0, 0.0, 0.0, self.exchanging))
        if len(self._steps) >= FLUSH_EVERY:
            self.flush()

    def _defer_busy(self, rec: CommRecorder) -> float:
        """Keep this step's collective events (CUDA) for :meth:`flush`; 0 until then."""
        events = self._comm_events
        self._deferred_busy.append((len(self._steps), len(events), len(rec.launches), len(rec.completions)))
        events.extend(rec.launches)
        events.extend(rec.completions)
        return 0.0

    def _resolve_busy(self, first_event: Any) -> None:
        """Each pending step's busy communication time from its events (synchronized already)."""
        clock, events, steps = self.clock, self._comm_events, self._steps
        for index, at, launched, completed in self._deferred_busy:
            seconds = [clock.seconds(first_event, e) for e in events[at:at + launched + completed]]
            busy = union_seconds(seconds[:launched], seconds[launched:])
            first, count, weight, _, nbytes, buckets, exchanging = steps[index]
            steps[index] = (first, count, weight, busy, nbytes, buckets, exchanging)
        self._deferred_busy.clear()
        events.clear()

    # ------------------------------------------------------------------------------ resolving
    def flush(self) -> None:
        """Resolve every pending step into the totals (on CUDA: one synchronization, here only)."""
        if not self._steps:
            return
        clock = self.clock
        if clock.deferred:
            clock.synchronize()
            stamps: list[Any] = [0.0] * len(self._stamp)  # events as seconds since the first: then one
            first_event = self._stamp[0]                  # subtraction per edge, as for host stamps
            for i, event in enumerate(self._stamp):
                stamps[i] = clock.seconds(first_event, event)
            if self._deferred_busy:
                self._resolve_busy(first_event)
        else:
            stamps = self._stamp  # perf_counter floats already
        phases = self._phase
        lag, samples = self.lag, self.lag.buffer
        sums = [0.0] * len(PHASES)  # by phase index: one dict update per phase per flush, not per edge
        # Window figures in locals, written back once: this loop runs for every step of the run.
        weights, timed_steps, profiled_seconds, busy_sum, bytes_sum, buckets_sum = 0, 0, 0.0, 0.0, 0.0, 0.0
        squares, window_sum, window_count, windows = 0.0, self._window_sum, self._window_count, self.windows
        step = self._last_step
        for first, count, weight, busy, nbytes, buckets, exchanging in self._steps:
            end = first + count
            start = previous = stamps[first]
            step = stamps[end - 1] - start
            if not weight:
                continue
            # A timed step's phases also go to the straggler buffer (offset base), unweighted, in place.
            base = lag.slot() if exchanging else -1
            for i in range(first + 1, end):
                now = stamps[i]
                sums[phases[i]] += (now - previous) * weight
                if base >= 0:
                    samples[base + phases[i]] += now - previous
                previous = now
            if base >= 0:
                samples[base + STEP_COLUMN] = step
            timed_steps += 1
            weights += weight
            profiled_seconds += step * weight
            squares += step * step * weight
            window_sum += step
            window_count += 1
            if window_count == WINDOW_STEPS:
                windows.append(window_sum / WINDOW_STEPS)
                window_sum, window_count = 0.0, 0
            busy_sum += busy * weight
            bytes_sum += nbytes * weight
            buckets_sum += buckets * weight
        self._last_step = step
        self.timed_steps += timed_steps
        self.profiled_weight += weights
        self.profiled_seconds += profiled_seconds
        self.profiled_squares += squares
        self._window_sum, self._window_count = window_sum, window_count
        if len(windows) > MAX_WINDOWS:  # a long run: halve the resolution, keep the whole run
            windows[:] = [(a + b) / 2 for a, b in zip(windows[::2], windows[1::2], strict=False)]
        self.window_weight += weights
        totals = self.totals
        totals["comm_busy"] += busy_sum
        totals["comm_bytes"] += bytes_sum
        totals["comm_buckets"] += buckets_sum
        for name, value in zip(PHASES, sums, strict=True):
            self.totals[name] += value
            self.window[name] += value
        self._steps.clear()
        phases.clear()
        self._stamp.clear()
        clock.recycle()

    @property
    def profiled_steps(self) -> int:
        """Steps after the warm-up: those the statistics stand for (timed or not)."""
        return max(0, self.steps - self.warmup_steps) if self.enabled else 0

    @property
    def last_step_seconds(self) -> float:
        """The latest timed step's length (resolves pending steps: on CUDA, one synchronization)."""
        self.flush()
        return self._last_step

    def per_step(self) -> dict[str, float]:
        """Mean per profiled step: seconds for each phase and ``step``, bytes and buckets for comm."""
        self.flush()
        n = max(1, self.profiled_weight)  # a weighted mean: each timed step for the steps it stands for
        out = {key: value / n for key, value in self.totals.items()}
        out["step"] = self.profiled_seconds / n
        out["step_std"] = max(0.0, self.profiled_squares / n - out["step"] ** 2) ** 0.5
        out["data_host"] = self.data_host_total / n
        native = self.recorder.native() if self.recorder.native is not None else None
        if native is not None:
            # Busy time, bytes and buckets from DDP's own timers; exposed time (after the last gradient)
            # from this run's stamps, bounded by the busy time (the rest is DDP's bookkeeping: backward).
            exposed = min(out["comm_exposed"], native["busy"])
            out.update(backward=out["backward"] + out["comm_exposed"] - exposed, comm_exposed=exposed,
                       comm_busy=native["busy"], comm_bytes=native["bytes"], comm_buckets=native["buckets"])
        return out

    def take_window(self) -> dict[str, float]:
        """Mean seconds per phase since the previous call (for periodic TensorBoard scalars)."""
        self.flush()
        n = self.window_weight
        out = {p: s / n for p, s in self.window.items()} if n else {}
        self.window = dict.fromkeys(PHASES, 0.0)
        self.window_weight = 0
        return out
