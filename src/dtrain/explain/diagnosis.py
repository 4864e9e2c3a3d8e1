"""The doctor's diagnosis as typed records: every factor's row, the recommendations, the scaling estimate
and ``--try``'s predictions. Nothing reads them by string key; :meth:`Diagnosis.to_json` writes the
``--json`` document (its keys and order are the command's public format).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dtrain.explain.advice import Straggler
from dtrain.explain.efficiency import Efficiency

if TYPE_CHECKING:
    from dtrain.profiling.script.findings import Finding

# A config value as the doctor proposes it (an int, a name, a bool).
ConfigValue = int | float | str | bool | None
# JSON as the standard library writes it (the goodput model's document).
Json = dict[str, object]


def config_text(value: object) -> str:
    """A config value as YAML writes it on one line: ``{batches: 59}``, ``null``, ``true``."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {config_text(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def slot_words(slots: int, workers_only: bool) -> str:
    """'2 slot(s)'; '1 worker slot(s) (servers apart)' where only the workers count (a parameter server)."""
    return f"{slots} {'worker slot(s) (servers apart)' if workers_only else 'slot(s)'}"


@dataclass(frozen=True, slots=True)
class Change:
    """One config change and its predicted samples/s over today's (None: not predicted)."""

    key: str
    value: ConfigValue
    predicted_speedup: float | None

    def to_json(self) -> Json:
        return {"key": self.key, "value": self.value, "predicted_speedup": self.predicted_speedup}


@dataclass(slots=True)
class Advice:
    """What one factor proposes: a change (``key`` None: nothing to try), why, and an alternative change.

    ``bound``: the predicted figure is only an upper bound (``interval`` is then (1, bound) and
    ``predicted_speedup`` None): the change is shown with its bound, never advised on it. ``declined``: the
    factor's change was predicted to gain too little to advise (its ``why`` says so)."""

    key: str | None
    value: ConfigValue
    why: str
    predicted_speedup: float | None
    alternative: Change | None = None
    straggler: Straggler | None = None
    bound: float | None = None
    declined: bool = False

    @property
    def action(self) -> str:
        return f"{self.key}: {config_text(self.value)}"


@dataclass(slots=True)
class FactorRow:
    """One row of the doctor's table: a factor's seconds per step, its share of the step, and its advice."""

    factor: str
    share: float
    seconds_per_step: float
    advice: Advice
    predicted_interval: tuple[float, float] | None = None

    @property
    def key(self) -> str | None:
        return self.advice.key

    @property
    def value(self) -> ConfigValue:
        return self.advice.value

    @property
    def why(self) -> str:
        return self.advice.why

    @property
    def predicted_speedup(self) -> float | None:
        return self.advice.predicted_speedup

    def to_json(self) -> Json:
        a = self.advice
        out: Json = {"factor": self.factor, "share": self.share, "seconds_per_step": self.seconds_per_step,
                     "key": a.key, "value": a.value, "why": a.why, "predicted_speedup": a.predicted_speedup}
        if a.alternative is not None:
            out["alternative"] = a.alternative.to_json()
        if a.straggler is not None:
            out["straggler"] = a.straggler.to_json()
        if a.bound is not None:
            out["predicted_bound"] = a.bound
        if self.predicted_interval is not None:
            out["predicted_interval"] = list(self.predicted_interval)
        return out


@dataclass(slots=True)
class Recommendation:
    """A change to try, from the factor that proposes it (or ``scaling``, ``checkpoints``)."""

    factor: str
    key: str
    value: ConfigValue
    predicted_speedup: float
    why: str | None = None  # checkpoints only: the goodput model's reason
    predicted_interval: tuple[float, float] | None = None

    @property
    def action(self) -> str:
        return f"{self.key}: {config_text(self.value)}"

    def to_json(self) -> Json:
        out: Json = {"factor": self.factor, "key": self.key, "value": self.value,
                     "predicted_speedup": self.predicted_speedup, "action": self.action}
        if self.why is not None:
            out["why"] = self.why
        if self.predicted_interval is not None:
            out["predicted_interval"] = list(self.predicted_interval)
        return out


@dataclass(frozen=True, slots=True)
class Scaling:
    """One slot doing the whole global batch, by the cost model (``observed`` False: not estimated)."""

    estimated_one_slot_speedup: float | None
    slower_than_one_slot: bool
    estimated_scaling_efficiency: float | None = None
    estimated_speedup_vs_one_slot: float | None = None
    estimated_speedup_vs_one_slot_interval: tuple[float, float] | None = None
    estimated_one_slot_step_seconds: float | None = None
    work_growth_with_batch: float | None = None

    def to_json(self) -> Json:
        if self.estimated_scaling_efficiency is None:  # phases not observed: nothing estimated
            return {"estimated_one_slot_speedup": self.estimated_one_slot_speedup,
                    "slower_than_one_slot": self.slower_than_one_slot}
        if self.estimated_speedup_vs_one_slot is None:  # one slot: it is the run itself
            return {"estimated_one_slot_speedup": self.estimated_one_slot_speedup,
                    "slower_than_one_slot": self.slower_than_one_slot,
                    "estimated_scaling_efficiency": self.estimated_scaling_efficiency}
        interval = self.estimated_speedup_vs_one_slot_interval
        return {"estimated_one_slot_speedup": self.estimated_one_slot_speedup,
                "estimated_speedup_vs_one_slot": self.estimated_speedup_vs_one_slot,
                "estimated_speedup_vs_one_slot_interval": list(interval) if interval is not None else None,
                "estimated_scaling_efficiency": self.estimated_scaling_efficiency,
                "estimated_one_slot_step_seconds": self.estimated_one_slot_step_seconds,
                "work_growth_with_batch": self.work_growth_with_batch,
                "slower_than_one_slot": self.slower_than_one_slot}


@dataclass(frozen=True, slots=True)
class TryResult:
    """``--try KEY=VALUE``: the predicted samples/s and gain with its 80% interval, or why there is none."""

    change: str  # as the user wrote it
    key: str
    value: ConfigValue
    samples_per_second: float | None
    gain: float | None
    low: float | None
    high: float | None
    inputs: dict[str, str]  # what the prediction changed in the cost model's target, and where inputs came from
    reason: str | None = None  # why no figure ("cannot predict X because ...")
    # Each term of the cost model at the run and at the change (dtrain.explain.terms.base.TermValue.to_json):
    # its seconds, one standard deviation, its inputs with their sources; empty where nothing was priced.
    terms: list[Json] = field(default_factory=list)

    def to_json(self) -> Json:
        return {"try": self.change, "key": self.key, "value": self.value,
                "samples_per_second": self.samples_per_second, "gain": self.gain, "low": self.low,
                "high": self.high, "inputs": self.inputs, "reason": self.reason, "terms": self.terms}


@dataclass(slots=True)
class Diagnosis:
    """The doctor's whole answer: ranked factors (their seconds add up to the step), recommendations,
    the verdict and the scaling estimate; ``finish`` and ``tries`` when asked for."""

    slots: int
    samples_per_second: float
    step_seconds: float
    top_factor: str | None
    phases_observed: bool
    verdict: str
    factors: list[FactorRow]
    recommendations: list[Recommendation]
    scaling: Scaling
    unobserved_phases: list[str] | None = None
    finish: Json | None = None
    finish_asked: bool = False  # ``--mttf``: the document says ``finish``, null where none was computed
    tries: list[TryResult] = field(default_factory=list)
    # MFU and the first steps (explain.efficiency); none for a profile written before them.
    efficiency: Efficiency = field(default_factory=lambda: Efficiency(None, None, None, []))
    # Slots that train, where others do not (a parameter server's servers): the title says "worker slot(s)".
    workers_only: bool = False
    # A script's run (dtrain.explain.scriptadvice): what only a script shows, and changes to try from outside.
    script_findings: list[Finding] = field(default_factory=list)
    script_tries: list[tuple[str, str]] = field(default_factory=list)

    def factor(self, name: str) -> FactorRow | None:
        """The row of factor ``name``, or None."""
        return next((f for f in self.factors if f.factor == name), None)

    def to_json(self) -> Json:
        out: Json = {"slots": self.slots, "samples_per_second": self.samples_per_second,
                     "step_seconds": self.step_seconds, "top_factor": self.top_factor,
                     "phases_observed": self.phases_observed}
        if self.unobserved_phases is not None:
            out["unobserved_phases"] = list(self.unobserved_phases)
        out.update({"verdict": self.verdict, "factors": [f.to_json() for f in self.factors],
                    "recommendations": [r.to_json() for r in self.recommendations],
                    "scaling": self.scaling.to_json()})
        if self.finish_asked:
            out["finish"] = self.finish
        if self.tries:
            out["tries"] = [t.to_json() for t in self.tries]
        out.update(self.efficiency.to_json())
        if self.script_findings or self.script_tries:
            out["script_findings"] = [f.to_json() for f in self.script_findings]
            out["script_tries"] = [{"try": item, "why": why} for item, why in self.script_tries]
        return out
