"""What another precision would do to a run's compute: one estimate for the doctor, ``--try`` and ``dtrain plan``.

Measured matmul peaks (``device_facts.matmul_tflops``) say how much faster a matmul runs in bf16 or TF32, but a
training step is not only matmuls: attention's softmax, norms, element-wise work, the optimizer and memory
traffic do not speed up by the same factor. So a matmul peak ratio is only an upper bound of the compute's
speed-up (every second of compute a matmul at peak), never a prediction. A prediction needs the model's own
training step timed under each precision: ``profile.json``'s ``model_steps``
(:class:`~dtrain.profiling.record.ModelSteps`); on a CPU with bf16 units, bf16-mixed autocast can be slower
than float32, and then the prediction says slower.

A change of slots also changes each slot's batch and threads, and the gain moves with both (on a CPU without
bf16 units, bf16 gains little from a second thread and loses more per sample: docs/benchmarks.md). Where the
steps were timed at twice the batch and at other thread counts too, the gain at a target's shape comes from
those (:class:`GainCurve`), not from the run's shape carried unchanged.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtrain.profiling.record import ModelSteps, ProfileRecord

# A shape of the timed steps: (precision, batch factor 1 or 2, threads).
Shape = tuple[str, int, int]

# The config's names of the precisions, and the matmul probe's names for them.
MATMUL_NAME = {"32-true": "fp32", "tf32": "tf32", "bf16-mixed": "bf16", "16-mixed": "fp16"}
# A peak ratio below this is no reason to name a precision at all.
MIN_PEAK_RATIO = 1.05


@dataclass(frozen=True, slots=True)
class Line:
    """At one thread count, each precision's compute (its timed step less the optimizer's) as a line in the
    per-slot batch: ``fixed + per_batch * x`` at ``x`` times the run's per-slot batch; ``spread``: one relative
    standard deviation of the gain it gives, from its four timed settings."""

    threads: int
    run_fixed: float
    run_per_batch: float
    other_fixed: float
    other_per_batch: float
    spread: float

    def gain(self, x: float) -> float:
        other = self.other_fixed + self.other_per_batch * x
        return (self.run_fixed + self.run_per_batch * x) / other if other > 0 else 1.0


@dataclass(frozen=True, slots=True)
class GainCurve:
    """A precision's compute gain at another per-slot batch and thread count than the run's: the run's precision
    and the other timed at the batch and twice it, at the run's threads and (a CPU) others
    (``model_steps.shapes``). Each precision's step is a fixed part and a per-sample part, so the gain moves
    from the ratio of the fixed parts (small batches) to that of the per-sample parts (large ones); between
    thread counts timed it is interpolated in 1 / threads (Amdahl's), beyond them held at the nearest."""

    batch: int  # the run's per-slot batch
    lines: tuple[Line, ...]  # by thread count, ascending
    bound: float | None = None  # the matmul peak ratio no gain beats

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> GainCurve:
        """The curve ``dataclasses.asdict`` wrote (a stored bench row's)."""
        return cls(record["batch"], tuple(Line(**line) for line in record["lines"]), record.get("bound"))

    def at(self, batch: float, threads: int) -> float:
        """The gain at ``batch`` samples per slot on ``threads`` threads."""
        x = batch / self.batch if self.batch else 1.0
        gain = self._across_threads(threads, lambda line: line.gain(x))
        return min(gain, self.bound) if self.bound is not None else gain

    def spread_at(self, threads: int) -> float:
        """One relative standard deviation of :meth:`at` on ``threads`` threads (the nearer lines' spread)."""
        return self._across_threads(threads, lambda line: line.spread)

    def _across_threads(self, threads: int, value: Callable[[Line], float]) -> float:
        lines = self.lines
        if threads <= lines[0].threads:
            return value(lines[0])
        for below, above in itertools.pairwise(lines):
            if threads <= above.threads:
                w = (1 / below.threads - 1 / threads) / (1 / below.threads - 1 / above.threads)
                return (1 - w) * value(below) + w * value(above)
        return value(lines[-1])


@dataclass(frozen=True, slots=True)
class PrecisionEstimate:
    """The compute speed-up of training in ``precision`` instead of the run's.

    ``gain``: measured on the model's own steps (None: not measured, then only ``bound`` is known);
    ``bound``: the measured matmul peak ratio, which no step's compute can beat (None: not measured)."""

    precision: str
    gain: float | None
    bound: float | None
    source: str  # in words, for the doctor's why and --try's inputs
    spread: float = 0.0  # one relative standard deviation of ``gain`` from its timed steps' spread (0: unknown)
    data: float | None = None  # seconds per step the data wait becomes at least (a host-bound step; None: as run)
    curve: GainCurve | None = None  # the gain at other batches and thread counts (None: ``gain`` everywhere)

    def changes(self) -> dict[str, float | GainCurve | None]:
        """The :class:`~dtrain.explain.target.Target` fields of training in this precision (its gain measured)."""
        return {"precision_gain": self.gain, "precision_spread": self.spread, "precision_data": self.data,
                "precision_curve": self.curve}


def model_steps(profile: ProfileRecord) -> ModelSteps | None:
    """The run's timed model steps, where its profile has them (a profile of an older dtrain has none)."""
    return profile.model_steps


def peak_ratio(profile: ProfileRecord, current: str, other: str) -> float | None:
    """The measured matmul TFLOPS of ``other`` over ``current`` (config names), or None where not measured."""
    facts = profile.device_facts
    if facts is None or facts.type != "cuda" or facts.matmul_tflops is None:
        return None
    if current not in MATMUL_NAME or other not in MATMUL_NAME:
        return None
    base = facts.matmul_tflops.of(MATMUL_NAME[current])
    return facts.matmul_tflops.of(MATMUL_NAME[other]) / base if base > 0 else None


def estimate(profile: ProfileRecord, precision: str) -> PrecisionEstimate:
    """Training in ``precision``: measured from the model's own steps where timed (a peak ratio only bounds
    it), else the peak ratio as a bound alone."""
    bound = peak_ratio(profile, profile.precision, precision)
    steps = model_steps(profile)
    if precision == profile.precision:
        return PrecisionEstimate(precision, 1.0, 1.0, "the run's own precision")
    gain = compute_speedup(profile, steps, precision) if steps is not None else None
    if gain is not None:
        if bound is not None:  # a step cannot beat its matmuls' peak: noise in a short timing can
            gain = min(gain, bound)
        data = host_bound_data(profile, steps, precision) if steps is not None else None
        waits = (f"; the host is the bound there, so each step also waits {1e3 * data:.2f} ms for its batch (the run's "
                 "fetch, timed on the host)" if data is not None and data > profile.seconds_per_step.data.mean else "")
        curve = gain_curve(profile, steps, precision, bound) if steps is not None else None
        shapes = " at the batch and twice it" + (" and at other thread counts" if curve and len(curve.lines) > 1
                                                  else "") if curve is not None else ""
        return PrecisionEstimate(precision, gain, bound, f"the model's own step timed in {profile.precision} and "
                                 f"{precision}{shapes} at the end of the run (measured; its float32 optimizer step "
                                 f"left out){waits}", gain_spread(profile, steps, precision), data, curve)
    if bound is not None:
        return PrecisionEstimate(precision, None, bound, f"matmuls ran {bound:.1f}x faster in {precision} on this "
                                 f"{_device(profile)} (measured); only the matmul share of the step speeds up, and "
                                 "its size was not measured")
    why = steps.skipped.get(precision) if steps is not None else None
    return PrecisionEstimate(precision, None, None, f"neither the model's step nor matmuls were timed in "
                             f"{precision} on this {_device(profile)}" + (f" ({why})" if why else ""))


def compute_speedup(profile: ProfileRecord, steps: ModelSteps, precision: str) -> float | None:
    """How many times faster forward + backward run in ``precision`` than in the run's, from the timed steps:
    the optimizer's step stays in float32 whatever the autocast, so the run's measured optimizer time is taken
    out of both steps where it is a small part of them (else the whole steps' ratio: a noisy difference of two
    close figures would be worse). None where either precision was not timed."""
    mine, other = steps.seconds_per_step.get(steps.run_precision), steps.seconds_per_step.get(precision)
    if not mine or not other:
        return None
    optimizer = profile.seconds_per_step.optimizer.min
    if optimizer < 0.5 * min(mine, other):
        return (mine - optimizer) / (other - optimizer)
    return mine / other


def _timed(steps: ModelSteps) -> dict[Shape, tuple[float, float]]:
    """Every timed setting of ``steps`` by shape: (median seconds, relative spread; 0 where not kept)."""
    threads = steps.threads or 0
    out = {(name, 1, threads): (seconds, steps.relative_spread.get(name, 0.0))
           for name, seconds in steps.seconds_per_step.items()}
    if steps.double_batch_seconds_per_step:
        out[(steps.run_precision, 2, threads)] = (steps.double_batch_seconds_per_step,
                                                  steps.relative_spread.get("double", 0.0))
    out.update({(s.precision, s.batch_factor, s.threads): (s.seconds, s.relative_spread or 0.0) for s in steps.shapes})
    return out


def _optimizer_at(profile: ProfileRecord, threads: int, at_run: int) -> float:
    """The run's optimizer step (float32 in any precision) on ``threads`` threads: as measured at the run's, scaled
    by the solo probe's optimizer steps at both where it timed them."""
    measured = profile.seconds_per_step.optimizer.min
    solo = {p.threads: p.optimizer_seconds for p in profile.solo_probe.points} if profile.solo_probe else {}
    if threads != at_run and solo.get(threads, 0) > 0 and solo.get(at_run, 0) > 0:
        return measured * solo[threads] / solo[at_run]
    return measured


def _line(mine: tuple[float, float], mine2: tuple[float, float] | None, other: tuple[float, float],
          other2: tuple[float, float] | None, optimizer: float, threads: int) -> Line:
    """One :class:`Line` from the settings timed at ``threads`` (twice the batch None: the gain held at every
    batch), the optimizer taken out as :func:`compute_speedup` does."""
    figures = [mine[0], other[0], *(f[0] for f in (mine2, other2) if f is not None)]
    if optimizer >= 0.5 * min(figures):
        optimizer = 0.0

    def fixed_and_per_batch(one: float, two: float | None) -> tuple[float, float]:
        one -= optimizer
        if two is None:
            return 0.0, one
        per = min(one, max(0.0, two - optimizer - one))  # a step neither shrinks with the batch nor grows past it
        return one - per, per

    both = mine2 is not None and other2 is not None
    run_fixed, run_per = fixed_and_per_batch(mine[0], mine2[0] if both and mine2 else None)
    other_fixed, other_per = fixed_and_per_batch(other[0], other2[0] if both and other2 else None)
    spreads = [mine[1], other[1], *((mine2[1], other2[1]) if both and mine2 and other2 else ())]
    return Line(threads, run_fixed, run_per, other_fixed, other_per, math.hypot(*spreads))


def gain_curve(profile: ProfileRecord, steps: ModelSteps, precision: str, bound: float | None) -> GainCurve | None:
    """The gain of ``precision`` at other batches and threads (:class:`GainCurve`), where the model's steps were
    timed in it at twice the batch or at another thread count (a dtrain before 2026-11-28 timed neither: None)."""
    if not steps.shapes or steps.threads is None:
        return None
    timed, run = _timed(steps), steps.run_precision
    lines = []
    for threads in sorted({t for (_, _, t) in timed}):
        mine, other = timed.get((run, 1, threads)), timed.get((precision, 1, threads))
        if mine is None or other is None:
            continue
        optimizer = _optimizer_at(profile, threads, steps.threads)
        lines.append(_line(mine, timed.get((run, 2, threads)), other, timed.get((precision, 2, threads)),
                           optimizer, threads))
    if not any(line.threads == steps.threads for line in lines):
        return None
    return GainCurve(steps.per_slot_batch_size, tuple(lines), bound)


def host_bound_data(profile: ProfileRecord, steps: ModelSteps, precision: str) -> float | None:
    """On a GPU, the seconds a step in ``precision`` waits for its batch: the run's fetch of a batch, timed on the
    host, less the device time the host has to spare in that precision (a sample's seconds over the host's own
    to queue it). In a run the device waits for a host-bound step's fetch, which the probe's steps (on one
    batch kept on the device) leave out; where the device is the bound the host fetches while it computes.
    None on a CPU (its data phase is the host's already) or where the probe kept no host figures."""
    facts = profile.device_facts
    fetch, seconds = steps.loop_data_host_seconds, steps.seconds_per_step.get(precision)
    host = steps.host_seconds_per_step.get(precision)
    if facts is None or facts.type != "cuda" or fetch is None or not seconds or host is None:
        return None
    return max(0.0, fetch - max(0.0, seconds - host))


def gain_spread(profile: ProfileRecord, steps: ModelSteps, precision: str) -> float:
    """One relative standard deviation of :func:`compute_speedup`'s figure, from the spread of the two
    precisions' timed steps (each step's own spread, carried through the optimizer's subtraction where
    :func:`compute_speedup` takes it out); 0 where the profile kept no spread (an older dtrain)."""
    mine, other = steps.seconds_per_step.get(steps.run_precision), steps.seconds_per_step.get(precision)
    spread_mine, spread_other = steps.relative_spread.get(steps.run_precision), steps.relative_spread.get(precision)
    if not mine or not other or spread_mine is None or spread_other is None:
        return 0.0
    optimizer = profile.seconds_per_step.optimizer.min
    if optimizer >= 0.5 * min(mine, other):
        optimizer = 0.0
    return math.hypot(spread_mine * mine / (mine - optimizer), spread_other * other / (other - optimizer))


def batch_spread(steps: ModelSteps | None) -> float:
    """One relative standard deviation of the step's growth from the batch to twice it, from the spread of
    the run's-precision steps at both (0 where not timed or no spread kept)."""
    if steps is None or steps.double_batch_seconds_per_step is None:
        return 0.0
    return math.hypot(steps.relative_spread.get(steps.run_precision, 0.0), steps.relative_spread.get("double", 0.0))


def best(profile: ProfileRecord) -> PrecisionEstimate | None:
    """The lower precision worth naming for this run: the fastest measured (its gain, or its bound where only
    matmul peaks were measured); None where nothing lower was measured, or the run is mixed precision already."""
    if profile.precision not in ("32-true", "tf32"):
        return None
    candidates = [estimate(profile, p) for p in ("bf16-mixed", "tf32") if p != profile.precision]
    measured = [c for c in candidates if c.gain is not None]
    if measured:
        return max(measured, key=lambda c: c.gain or 0.0)
    facts = profile.device_facts
    if facts is None or not facts.tensor_cores:
        return None
    bounded = [c for c in candidates if c.bound is not None and c.bound > MIN_PEAK_RATIO]
    return max(bounded, key=lambda c: c.bound or 0.0) if bounded else None


def _device(profile: ProfileRecord) -> str:
    facts = profile.device_facts
    return facts.name if facts is not None else profile.device
