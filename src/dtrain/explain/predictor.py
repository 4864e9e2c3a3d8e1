"""Every predicted gain of the doctor, ``--try`` and ``dtrain plan``, from one cost model call.

A change is a :class:`~dtrain.explain.costmodel.Target` built by :func:`target_at` from the run's own
(:meth:`CostModel.measured_target`): the measured slot and node count keep the run's threads, any other
takes the launcher's rule. Its gain is its predicted samples/s over the model's own figure for the run as
it was (so the model's bias cancels), with the 80% interval of :func:`ratio`.
``dtrain plan`` prices its rows with the same targets, so the doctor and the planner give one answer.
A change the model cannot price for the run's strategy (:mod:`dtrain.explain.exchange`) gets no gain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dtrain.explain.costmodel import CostModel, Prediction, Target
from dtrain.explain.exchange import Unpriced, unpriced
from dtrain.explain.precision import GainCurve
from dtrain.profiling.record import ProfileRecord

# Beyond this far from its point on either side, an 80% interval says the model cannot price the change: the
# answer gives the interval and points to --verify, which measures it, instead of a point figure (issue 73).
WIDE = 1.25


def too_wide(value: float, low: float, high: float) -> bool:
    """Whether the 80% interval ``low``-``high`` around ``value`` is wider than +/-25% (:data:`WIDE`)."""
    slack = 1e-9  # an interval capped at exactly +/-25% (every input measured here) is not wider
    return value > 0 and (high > value * WIDE * (1 + slack) or low * WIDE * (1 + slack) < value)


def wide_reason(change: str, low: float, high: float, widest: str, item: str = "KEY=VALUE") -> str:
    """Why a change gets no point figure: its interval, the input that widens it most, and what measures it
    (``item``: the change as ``--try`` spells it)."""
    return (f"cannot predict {change} to within +/-25%: its 80% interval is {low:.3g}x-{high:.3g}x samples/s"
            + (f" (widest: {widest})" if widest else "") + f"; dtrain doctor RUN --try {item} --verify measures it")


# One change's fields on a Target (precision_gain, compression, ...), as dataclasses.replace takes them.
TargetValue = int | float | str | bool | GainCurve | None


def target_at(model: CostModel, slots: int | None = None, nodes: int | None = None,
              **changes: TargetValue) -> Target:
    """The run's target with ``changes``; on another slot or node count the threads follow the launcher's
    rule (as a new run there would get them), on the run's own they stay as measured. Fewer slots than a run
    with a chronically late rank leave that rank out (the slot to give up first), unless ``late_gone`` says."""
    here = model.measured_target()
    slots = here.slots if slots is None else slots
    nodes = here.nodes if nodes is None else nodes
    threads = here.threads if (slots, nodes) == (here.slots, here.nodes) else None
    if "late_gone" not in changes and model.late > 0 and slots < here.slots:
        changes["late_gone"] = True
    return replace(here, slots=slots, nodes=nodes, threads=threads, **changes)


@dataclass(frozen=True, slots=True)
class Gain:
    """A change's predicted samples/s over the run's (by the same model), its 80% interval, the prediction."""

    value: float
    low: float
    high: float
    prediction: Prediction


class Predictor:
    """The doctor's cost model (or ``dtrain plan``'s, when given) and the gains it predicted, kept by action
    for the table, the advice, ``--verify`` and ``--try``."""

    def __init__(self, profile: ProfileRecord, model: CostModel | None = None) -> None:
        self.model = model if model is not None else CostModel.from_profile(profile)
        self.here = self.model.measured_target()
        self.base = self.model.predict(self.here)
        self.intervals: dict[str, tuple[float, float]] = {}
        self.unpriced: Unpriced | None = unpriced(profile)

    def refusal(self, target: Target) -> str | None:
        """Why ``target`` is not priced for this run (None: it is)."""
        found = self.unpriced
        return found.reason_for(target, self.here) if found is not None else None

    def predict(self, target: Target, less_step: float = 0.0) -> Gain:
        """``target``'s gain over the run (``less_step``: seconds a change removes that the model does not
        see, such as a chronic straggler's lag)."""
        pred = self.model.predict(target)
        value, low, high = ratio(pred, self.base)
        if less_step > 0:
            shrink = pred.step / max(pred.step - less_step, 1e-12)
            value, low, high = value * shrink, low * shrink, high * shrink
        return Gain(value, low, high, pred)

    def gain(self, action: str, *, less_step: float = 0.0, slots: int | None = None, nodes: int | None = None,
             **changes: TargetValue) -> float | None:
        """``action``'s predicted speed-up (``changes`` to the run's target, as :func:`target_at` takes them);
        its interval is kept under ``action``. None: a change the model does not price for this run."""
        target = target_at(self.model, slots, nodes, **changes)
        if self.refusal(target) is not None:
            return None
        found = self.predict(target, less_step)
        self.intervals[action] = (found.low, found.high)
        return found.value


def ratio(new: Prediction, base: Prediction) -> tuple[float, float, float]:
    """samples/s of ``new`` over ``base`` (same model: its biases cancel), with an 80% interval from
    ``new``'s own (the base is the measured run)."""
    value = new.samples_per_second / base.samples_per_second
    base_sps = base.samples_per_second
    return value, new.samples_per_second_low / base_sps, new.samples_per_second_high / base_sps
