"""Goodput: time and cost to finish a run when nodes fail, and the checkpoint period that minimizes them.

Model (Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future
Generation Computer Systems 22(3)). Failures are independent and exponential per node, so a job on ``n``
nodes fails with the system MTTF ``M = MTTF_node / n``. The run needs ``W`` seconds of work (step seconds x
batches left); it writes a checkpoint (``delta`` seconds, measured) after every ``tau`` seconds of work and,
after a failure, restarts the workers and reloads the last checkpoint (``R`` seconds) and redoes the work
since. A failure may strike during the work, the checkpoint or the restart alike. The expected wall time is::

    T = M * exp(R / M) * (exp((tau + delta) / M) - 1) * W / tau

``W / tau`` counts segments, each ending in a checkpoint; dtrain always checkpoints at the end, so a run with
no periodic checkpoints is the same formula with ``tau = W`` (one segment: a failure restarts from the
start). Without failures (``M`` infinite) it reduces to ``T = W + (W / tau) * delta``.

The optimum ``tau`` does not depend on ``R`` (``exp(R/M)`` is a constant factor): Young's first-order
``sqrt(2 delta M)`` and Daly's higher-order estimate (:func:`daly_period_seconds`). Both are seconds of
compute; the period the config takes is in batches, so they are converted (and the better of the two
neighbouring whole batch counts is kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dtrain.errors import UserError
from dtrain.explain.diagnosis import config_text

SECONDS_PER_HOUR = 3600.0
# A predicted saving below this share of the run's time is within the model's own error: no advice.
MIN_SAVING = 0.02


@dataclass(frozen=True, slots=True)
class GoodputInputs:
    """What the model needs: measured step and checkpoint costs, the run's size, and the user's failure
    rate and price.

    ``slots`` is the trial's total slots (all nodes); ``checkpoint_period_batches`` is the configured
    ``min_checkpoint_period`` in batches (None: only the final checkpoint); ``mttf_hours`` is per node
    (None: no failures); ``price_per_slot_hour`` None leaves the cost out.
    """

    step_seconds: float
    total_batches: int
    checkpoint_seconds: float
    restart_seconds: float
    nodes: int = 1
    slots: int = 1
    mttf_hours: float | None = None
    price_per_slot_hour: float | None = None
    checkpoint_period_batches: int | None = None

    def __post_init__(self) -> None:
        # The record is where CLI values and measurements meet: refuse what would make the model meaningless
        # here, naming the field, rather than returning nan or a negative time later.
        _require(self.step_seconds > 0 and math.isfinite(self.step_seconds), "step_seconds", self.step_seconds,
                 "must be a positive number of seconds (a measured step time)")
        _require(self.total_batches >= 1, "total_batches", self.total_batches, "must be at least 1 (max_length)")
        _require(self.checkpoint_seconds >= 0 and math.isfinite(self.checkpoint_seconds), "checkpoint_seconds",
                 self.checkpoint_seconds, "must be a number of seconds >= 0 (the measured checkpoint time)")
        _require(self.restart_seconds >= 0 and math.isfinite(self.restart_seconds), "restart_seconds",
                 self.restart_seconds, "must be a number of seconds >= 0 (restart workers and reload a checkpoint)")
        _require(self.nodes >= 1, "nodes", self.nodes, "must be at least 1")
        _require(self.slots >= self.nodes, "slots", self.slots, f"must be at least the number of nodes ({self.nodes})")
        if self.mttf_hours is not None:
            _require(self.mttf_hours > 0 and math.isfinite(self.mttf_hours), "mttf_hours", self.mttf_hours,
                     "must be a positive number of hours, e.g. --mttf 1000")
        if self.price_per_slot_hour is not None:
            _require(self.price_per_slot_hour > 0 and math.isfinite(self.price_per_slot_hour), "price_per_slot_hour",
                     self.price_per_slot_hour, "must be a positive price per slot-hour, e.g. --price 2.50")
        if self.checkpoint_period_batches is not None:
            _require(self.checkpoint_period_batches >= 1, "checkpoint_period_batches", self.checkpoint_period_batches,
                     "must be at least 1 batch (or null for only the final checkpoint)")

    @property
    def work_seconds(self) -> float:
        """Seconds of compute the run needs without failures or checkpoints: ``W``."""
        return self.step_seconds * self.total_batches

    @property
    def system_mttf_seconds(self) -> float | None:
        """Mean time between failures of the whole job in seconds (None: no failures)."""
        if self.mttf_hours is None:
            return None
        return system_mttf_hours(self.mttf_hours, self.nodes) * SECONDS_PER_HOUR


@dataclass(frozen=True, slots=True)
class Outcome:
    """The predicted finish of the run at one checkpoint period."""

    period_batches: int | None  # None: only the final checkpoint
    seconds: float  # expected wall time to finish, failures, checkpoints and restarts included
    failures: float  # expected number of failures on the way
    goodput: float  # useful work / wall time, W / T
    cost: float | None  # T hours x slots x price; None without a price

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for the report."""
        return {"period_batches": self.period_batches, "seconds": self.seconds, "failures": self.failures,
                "goodput": self.goodput, "cost": self.cost}


@dataclass(frozen=True, slots=True)
class Comparison:
    """The run as configured against the run at the period that minimizes its expected time.

    ``optimal`` is None without a failure rate: with no failures the only optimum is no periodic checkpoint,
    which is not advice to give a user who keeps checkpoints for other reasons (preemption, inspection).
    """

    configured: Outcome
    optimal: Outcome | None
    system_mttf_hours: float | None
    young_period_batches: int | None
    daly_period_batches: int | None
    advice: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for the report."""
        return {"configured": self.configured.to_dict(),
                "optimal": None if self.optimal is None else self.optimal.to_dict(),
                "system_mttf_hours": self.system_mttf_hours, "young_period_batches": self.young_period_batches,
                "daly_period_batches": self.daly_period_batches, "advice": self.advice}


def system_mttf_hours(mttf_hours_per_node: float, nodes: int) -> float:
    """MTTF of a job on ``nodes`` nodes that each fail independently and exponentially: the failure rates add,
    so the job's MTTF is the node's divided by ``nodes``."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    return mttf_hours_per_node / nodes


def young_period_seconds(checkpoint_seconds: float, mttf_seconds: float) -> float:
    """Young's (1974) first-order optimum seconds of compute between checkpoints: ``sqrt(2 delta M)``."""
    return math.sqrt(2.0 * checkpoint_seconds * mttf_seconds)


def daly_period_seconds(checkpoint_seconds: float, mttf_seconds: float) -> float:
    """Daly's (2006) higher-order optimum seconds of compute between checkpoints::

        tau = sqrt(2 delta M) * (1 + 1/3 sqrt(delta / 2M) + 1/9 (delta / 2M)) - delta   for delta < 2M
        tau = M                                                                       otherwise
    """
    delta, m = checkpoint_seconds, mttf_seconds
    if delta >= 2.0 * m:
        return m
    x = delta / (2.0 * m)
    return math.sqrt(2.0 * delta * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def period_batches(period_seconds: float, step_seconds: float) -> int:
    """A period in seconds of compute as whole batches (at least one)."""
    return max(1, round(period_seconds / step_seconds))


def expected_seconds(work_seconds: float, period_seconds: float, checkpoint_seconds: float,
                     restart_seconds: float, mttf_seconds: float | None) -> float:
    """Expected wall time to finish ``W`` seconds of work checkpointing every ``tau`` seconds of it (Daly)::

        T = M * exp(R / M) * (exp((tau + delta) / M) - 1) * W / tau

    ``mttf_seconds`` None means no failures: ``T = W + (W / tau) * delta``. A period longer than the work is
    the work (one segment, the final checkpoint). Infinite when the numbers overflow (the run practically
    never finishes).
    """
    w, delta, r = work_seconds, checkpoint_seconds, restart_seconds
    tau = min(period_seconds, w)
    if tau <= 0:
        raise ValueError(f"period_seconds must be > 0, got {period_seconds}")
    if mttf_seconds is None:
        return w + (w / tau) * delta
    m = mttf_seconds
    try:
        # expm1 keeps precision when tau + delta << M, where exp(..) - 1 would cancel to nothing.
        return m * math.exp(r / m) * math.expm1((tau + delta) / m) * (w / tau)
    except OverflowError:
        return math.inf


def outcome(inputs: GoodputInputs, batches: int | None) -> Outcome:
    """The expected finish of the run checkpointing every ``batches`` batches (None: only at the end)."""
    w = inputs.work_seconds
    n = inputs.total_batches if batches is None else min(batches, inputs.total_batches)
    m = inputs.system_mttf_seconds
    t = expected_seconds(w, n * inputs.step_seconds, inputs.checkpoint_seconds, inputs.restart_seconds, m)
    failures = 0.0 if m is None else t / m
    price = inputs.price_per_slot_hour
    cost = None if price is None else t / SECONDS_PER_HOUR * inputs.slots * price
    return Outcome(period_batches=batches, seconds=t, failures=failures, goodput=w / t if t > 0 else 0.0, cost=cost)


def optimal_period_batches(inputs: GoodputInputs) -> int | None:
    """The period in batches that minimizes the expected time: Daly's estimate, then the better of its two
    neighbouring whole batch counts. None when that is the whole run (only the final checkpoint) or when no
    failure rate was given."""
    m = inputs.system_mttf_seconds
    if m is None:
        return None
    exact = daly_period_seconds(inputs.checkpoint_seconds, m) / inputs.step_seconds
    candidates = {max(1, math.floor(exact)), max(1, math.ceil(exact))}
    best = min(sorted(candidates), key=lambda b: outcome(inputs, b).seconds)
    return None if best >= inputs.total_batches else best


def compare(inputs: GoodputInputs) -> Comparison:
    """The run as configured against the run at the optimal checkpoint period, with advice for
    ``min_checkpoint_period`` when the optimum saves at least 2% of the time (None otherwise)."""
    configured = outcome(inputs, inputs.checkpoint_period_batches)
    m = inputs.system_mttf_seconds
    if m is None:
        return Comparison(configured=configured, optimal=None, system_mttf_hours=None, young_period_batches=None,
                          daly_period_batches=None, advice=None)
    step, delta = inputs.step_seconds, inputs.checkpoint_seconds
    optimal = outcome(inputs, optimal_period_batches(inputs))
    return Comparison(configured=configured, optimal=optimal, system_mttf_hours=m / SECONDS_PER_HOUR,
                      young_period_batches=period_batches(young_period_seconds(delta, m), step),
                      daly_period_batches=period_batches(daly_period_seconds(delta, m), step),
                      advice=_advice(inputs, configured, optimal))


def _advice(inputs: GoodputInputs, configured: Outcome, optimal: Outcome) -> dict[str, Any] | None:
    t_conf, t_opt = configured.seconds, optimal.seconds
    # Same period (nothing to change), or no period finishes (advice would promise a saving of inf - inf).
    if optimal.period_batches == configured.period_batches or not math.isfinite(t_opt):
        return None
    saving = 1.0 if not math.isfinite(t_conf) else (t_conf - t_opt) / t_conf
    if saving < MIN_SAVING:
        return None
    value = None if optimal.period_batches is None else {"batches": optimal.period_batches}
    money = None
    if configured.cost is not None and optimal.cost is not None:
        money = configured.cost - optimal.cost if math.isfinite(configured.cost) else math.inf
    return {"key": "min_checkpoint_period", "value": value,
            "action": f"min_checkpoint_period: {config_text(value)}",
            "predicted_speedup": t_conf / t_opt,
            "predicted_time_saving_seconds": t_conf - t_opt, "predicted_time_saving_fraction": saving,
            "predicted_cost_saving": money, "why": _why(inputs, configured, optimal)}


def _why(inputs: GoodputInputs, configured: Outcome, optimal: Outcome) -> str:
    """One sentence: the failure rate the job sees, what the current period costs, and what the new one gives."""
    m_hours = system_mttf_hours(inputs.mttf_hours, inputs.nodes)  # type: ignore[arg-type]
    nodes = f"{inputs.nodes} nodes" if inputs.nodes > 1 else "1 node"
    conf_n = configured.period_batches
    if conf_n is None or conf_n >= inputs.total_batches:
        problem = "checkpointing only at the end means a failure throws away all the work done so far"
    elif optimal.period_batches is None or conf_n < optimal.period_batches:
        problem = (f"writing a {duration(inputs.checkpoint_seconds)} checkpoint every {_batches(conf_n)} spends more "
                   "time on checkpoints than it saves in redone work")
    else:
        problem = f"checkpointing every {_batches(conf_n)} redoes too much work after each failure"
    if optimal.period_batches is None:
        fix = "checkpointing only at the end"
    else:
        fix = (f"every {_batches(optimal.period_batches)} "
               f"({duration(optimal.period_batches * inputs.step_seconds)} of training)")
    money = ""
    if configured.cost is not None and optimal.cost is not None:
        money = f", {_money(configured.cost)} -> {_money(optimal.cost)}"
    return (f"with a node failing every {inputs.mttf_hours:g} h on average, {nodes} "
            f"{'sees' if inputs.nodes == 1 else 'see'} a failure about every "
            f"{duration(m_hours * SECONDS_PER_HOUR)}, and {problem}; {fix} finishes in about "
            f"{duration(optimal.seconds)} instead of {duration(configured.seconds)} "
            f"({optimal.failures:.1f} expected failures{money})")


def parse_price(text: str) -> float:
    """``--price PER_SLOT_HOUR``: a positive price per slot-hour, optionally with a leading '$'."""
    raw = text.strip()
    value = _positive(raw[1:].strip() if raw.startswith("$") else raw)
    if value is None:
        raise UserError(f"--price {text!r} is not a price: give a positive number per slot-hour, e.g. --price 2.50")
    return value


def parse_mttf_hours(text: str) -> float:
    """``--mttf HOURS``: a node's mean time to failure, a positive number of hours."""
    value = _positive(text.strip())
    if value is None:
        raise UserError(f"--mttf {text!r} is not a time: give a node's mean time to failure in hours, e.g. --mttf 1000")
    return value


def _positive(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value > 0 and math.isfinite(value) else None


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise UserError(f"{name}={value!r}: {rule}")


def _batches(n: int) -> str:
    return "batch" if n == 1 else f"{n} batches"


def duration(seconds: float) -> str:
    """Seconds in words: s, min, h or days."""
    if not math.isfinite(seconds):
        return "forever"
    if seconds < 120:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2g} s"
    if seconds < 2 * SECONDS_PER_HOUR:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * SECONDS_PER_HOUR:
        return f"{seconds / SECONDS_PER_HOUR:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _money(amount: float) -> str:
    return "unbounded cost" if not math.isfinite(amount) else f"${amount:,.2f}"
