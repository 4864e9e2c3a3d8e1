"""How sure a prediction of the cost model (:mod:`dtrain.explain.costmodel`) is: the seconds of a step each
uncertain input moves (its exposure), and one standard deviation of the step from each source.

The uncertainties themselves are fitted to stored held-out rows (:mod:`dtrain.explain.calibration`,
``src/dtrain/explain/fitted_intervals.json``); this module says which of them a prediction is exposed to.
"""

from __future__ import annotations

import math

from dtrain.explain import fitted
from dtrain.explain.target import Target
from dtrain.explain.terms.base import Model as CostModel


def exposures(model: CostModel, target: Target, parts: dict[str, float], step: float) -> dict[str, float]:
    """Seconds of the step that each uncertain input moves by one unit of its relative uncertainty (the
    fit's design: one standard deviation of the step is the root sum of squares of exposure x uncertainty)."""
    f = model.facts
    local, threads = model.local_threads(target)
    compute, exchange = parts["compute"], parts["exchange"]
    # Compute given on paper is another input than compute a run measured: their uncertainties differ.
    out = {"compute_given" if f.batch_given else "compute": compute, "data": parts["data"]}
    if not f.work.probed(threads):
        out["threads"] = compute
    if (target.machine_slots or local) > 1 and f.local_slots == 1 and f.device == "cpu":
        out["contention"] = compute
    batch = (target.global_batch or f.global_batch) / target.slots
    if not f.batch_given and batch != f.per_slot_batch:
        out["batch_extrapolation"] = compute * abs(math.log(batch / f.per_slot_batch))
    if f.replica_of_sharded:  # DDP priced from an FSDP run: its compute and optimizer were FSDP's
        out["sharded_to_replica"] = step
    if f.sharded is not None:  # FSDP's collectives, held as measured and scaled by the ring to other slots
        if (target.slots, target.nodes) != (f.slots, f.hosts):
            out["sharded_scaled"] = exchange
    elif f.holds_exchange:  # a parameter server's, as the run measured it per update
        out["exchange_held"] = exchange
    elif target.slots > 1:
        link = {"measured": "link_measured", "probed": "link_probe"}.get(model.link_source, "link_given")
        out[link] = exchange
        if target.nodes > 1:  # a datasheet's network on paper is another input than a --link beside a run
            out["inter_given" if f.batch_given else "link_between_hosts"] = exchange
        if f.batch_given:  # on paper no run calibrated anything: the links and the stragglers' spread only
            return {**out, "unmeasured_drift": step}
        if model.overhead_source != "measured":
            out["exchange_overhead"] = exchange
        if target.slots != max(2, f.slots):
            out["slot_extrapolation"] = exchange * abs(math.log(target.slots / max(2, f.slots)))
    if target.precision_gain != 1.0:
        # A precision's gain rests on a few steps timed at the end of the run, alone (no loader, no exchange
        # beside them, the caches warm): a whole run in that precision may gain less or more than they did.
        out["precision_probe"] = compute
    if target.data_workers_timed:
        # The run's own steps timed after it with that many loader processes: a few dozen of them, whose mean
        # moved 10-15% between runs (docs/benchmarks.md).
        out["loader_workers_timed"] = step
    elif target.data_workers_step is not None:
        # Other loader processes: the hand-over of each batch is probed, but their start-up is not modelled,
        # and on shared cores their competing with training's threads is priced as even shares, which a
        # 2-thread slot took 1.4x as long as (docs/benchmarks.md); the planted slow-data case's measured
        # gain was about half the predicted one (tests/explain/test_verify.py).
        out["loader_workers"] = step
    if len(model.facts.windows) < 3:
        out["unmeasured_drift"] = step
    return out

# Without a chronically late rank, the others' exchange is priced from the late rank's own: measured while the
# others waited, on a crowded host beside them. One standard deviation of half of it: a guess, not fitted (no
# stored row has a straggler; the one planted case measured, 4 slots on 2 cores with the late one left out,
# was predicted 6.84x and measured 6.52x).
LATE_GONE = "the exchange without the late rank (not measured)"
LATE_GONE_SD = 0.5


def uncertainties(model: CostModel, target: Target, parts: dict[str, float], step: float) -> dict[str, float]:
    """One standard deviation of the step from each source: the run's drift and the link fit's residual
    (measured), and each input's exposure times its fitted uncertainty."""
    u = fitted.load().uncertainty
    out = {name: u[name] * seconds for name, seconds in exposures(model, target, parts, step).items()}
    if len(model.facts.windows) >= 3:
        out["drift over the run"] = _drift(model.facts.windows) * step
    # The fit's residual is the measured link's; a link given between hosts prices the exchange there instead,
    # with its own uncertainty.
    if target.slots > 1 and model.link_residual > 0 and not (target.nodes > 1 and model.between_hosts is not None):
        out["link fit residual"] = model.link_residual * parts["exchange"]
    # The few timed model steps a precision's gain (or a batch's growth) rests on: their own measured spread.
    f = model.facts
    batch = (target.global_batch or f.global_batch) / target.slots
    precision_spread = target.precision_spread
    if target.precision_curve is not None:  # the timed settings the gain at this shape rests on
        precision_spread = max(precision_spread, target.precision_curve.spread_at(model.local_threads(target)[1]))
    if precision_spread > 0:
        out["model steps' spread (precision)"] = precision_spread * parts["compute"]
    if f.batch_spread > 0 and f.per_slot_batch and batch != f.per_slot_batch:
        # Measured at the batch and twice it: a change of a doubling or more carries all of it.
        out["model steps' spread (batch)"] = (f.batch_spread * parts["compute"]
                                              * min(1.0, abs(math.log2(batch / f.per_slot_batch))))
    if target.late_gone and model.late > 0 and target.slots > 1:
        out[LATE_GONE] = LATE_GONE_SD * parts["exchange"]
    return {name: value for name, value in out.items() if value > 0}


def _drift(windows: tuple[float, ...]) -> float:
    """Relative standard deviation of the run's mean step over its windows of steps (drift over the run), at
    least 3% (three or more windows)."""
    mean = sum(windows) / len(windows)
    var = sum((w - mean) ** 2 for w in windows) / (len(windows) - 1)
    return max(0.03, math.sqrt(var) / mean)
