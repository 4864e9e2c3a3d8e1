"""What another precision would do to a run's compute: one estimate for the doctor, ``--try`` and ``dtrain plan``.

Measured matmul peaks (``device_facts.matmul_tflops``) say how much faster a matmul runs in bf16 or TF32, but a
training step is not only matmuls: attention's softmax, norms, element-wise work, the optimizer and memory
traffic do not speed up by the same factor. So a matmul peak ratio is only an upper bound of the compute's
speed-up (every second of compute a matmul at peak), never a prediction. A prediction needs the model's own
training step timed under each precision: ``profile.json``'s ``model_steps``
(:class:`~dtrain.profiling.record.ModelSteps`); on a CPU with bf16 units, bf16-mixed autocast can be slower
than float32, and then the prediction says slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtrain.profiling.record import ModelSteps, ProfileRecord

# The config's names of the precisions, and the matmul probe's names for them.
MATMUL_NAME = {"32-true": "fp32", "tf32": "tf32", "bf16-mixed": "bf16", "16-mixed": "fp16"}
# A peak ratio below this is no reason to name a precision at all.
MIN_PEAK_RATIO = 1.05


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
        return PrecisionEstimate(precision, gain, bound, f"the model's own step timed in {profile.precision} and "
                                 f"{precision} at the end of the run (measured; its float32 optimizer step left "
                                 f"out){waits}", gain_spread(profile, steps, precision), data)
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
