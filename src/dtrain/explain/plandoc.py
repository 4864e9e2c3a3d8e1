"""``dtrain plan``'s document as typed records: one :class:`PlanRow` per configuration priced, and the
:class:`PlanDocument` around them (from a run, or on paper). :meth:`PlanDocument.to_json` writes the
``--json`` document; :meth:`PlanDocument.from_json` reads one written on paper (:mod:`dtrain.explain.paper`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.explain.costmodel import CostModel, Prediction, Target
from dtrain.explain.terms.base import MEASURED, PROBED, Input, TermValue

# JSON as the standard library writes it (the goodput model's document for a row).
Json = dict[str, object]


@dataclass(slots=True)
class PlanRow:
    """One configuration: its predicted samples/s with the 80% interval, efficiency, step and its parts."""

    slots: int
    nodes: int
    option: str
    change: str
    samples_per_second: float
    low: float
    high: float
    efficiency: float | None  # over linear scaling from one slot (None: one slot not priced, a sharded run's)
    seconds_per_step: float
    seconds_per_step_low: float
    seconds_per_step_high: float
    parts_seconds: dict[str, float]
    seconds_to_finish: float | None = None
    gain: float | None = None  # over the model's own figure for the run as it was (a run's plan only)
    finish: Json | None = None
    widest_input: str | None = None  # on paper: the input that widens the interval most
    extra: Json = field(default_factory=dict)  # figures a newer paper document adds, kept as they are
    terms: list[Json] = field(default_factory=list)  # each term at the run and here (a run's plan: explained())
    reason: str | None = None  # a run's plan: why no gain (an 80% interval wider than +/-25%: --verify measures it)

    @classmethod
    def of(cls, target: Target, option: str, change: str, pred: Prediction, one: Prediction | None) -> PlanRow:
        """The row of ``pred`` (``one``: one slot, for the efficiency; None where one slot is not priced)."""
        efficiency = pred.samples_per_second / (target.slots * one.samples_per_second) if one is not None else None
        return cls(target.slots, target.nodes, option, change, pred.samples_per_second,
                   pred.samples_per_second_low, pred.samples_per_second_high, efficiency, pred.step, pred.low,
                   pred.high, pred.parts)

    def to_json(self) -> Json:
        out: Json = {"slots": self.slots, "nodes": self.nodes, "option": self.option, "change": self.change,
                     "samples_per_second": self.samples_per_second, "low": self.low, "high": self.high,
                     "efficiency": self.efficiency, "seconds_per_step": self.seconds_per_step,
                     "seconds_per_step_low": self.seconds_per_step_low,
                     "seconds_per_step_high": self.seconds_per_step_high, "parts_seconds": self.parts_seconds,
                     "seconds_to_finish": self.seconds_to_finish}
        if self.gain is not None or self.reason is not None:
            out["gain"] = self.gain
        if self.reason is not None:
            out["reason"] = self.reason
        out["finish"] = self.finish
        if self.terms:
            out["terms"] = self.terms
        if self.widest_input is not None:
            out["widest_input"] = self.widest_input
        return {**out, **self.extra}


@dataclass(frozen=True, slots=True)
class Measured:
    """The run the plan starts from (on paper: one GPU as the model prices it)."""

    slots: int
    nodes: int
    samples_per_second: float
    model_samples_per_second: float


@dataclass(frozen=True, slots=True)
class RunCostsFacts:
    """What finishing a run costs (``--mttf``/``--price``): None on paper."""

    mttf_hours_per_node: float | None
    price_per_slot_hour: float | None
    checkpoint_seconds: float | None
    restart_seconds: float | None
    checkpoint_period_batches: int | None


@dataclass(slots=True)
class PlanDocument:
    """The plan: the rows, the model's inputs, the measured run or the paper spec, and the chart's path."""

    run_dir: str | None
    measured: Measured
    link: str | None
    total_batches: int | None
    inputs: list[Input]
    predictions: list[PlanRow]
    costs: RunCostsFacts | None = None  # a run's plan
    what_if: str | None = None  # a plan on paper: its spec and its scaling ("strong" | "weak")
    scaling: str | None = None
    png: str | None = None
    png_set: bool = False  # the command says where it drew the chart (or null: not drawn)
    interval: str = "80%"
    extra: Json = field(default_factory=dict)

    def to_json(self) -> Json:
        out: Json = {"run_dir": self.run_dir}
        if self.what_if is not None:
            out.update({"what_if": self.what_if, "scaling": self.scaling})
        m = self.measured
        out.update({"measured": {"slots": m.slots, "nodes": m.nodes, "samples_per_second": m.samples_per_second,
                                 "model_samples_per_second": m.model_samples_per_second},
                    "link": self.link, "total_batches": self.total_batches})
        if self.costs is not None:
            c = self.costs
            out.update({"mttf_hours_per_node": c.mttf_hours_per_node, "price_per_slot_hour": c.price_per_slot_hour,
                        "checkpoint_seconds": c.checkpoint_seconds, "restart_seconds": c.restart_seconds,
                        "checkpoint_period_batches": c.checkpoint_period_batches})
        out.update({"inputs": [i.to_json() for i in self.inputs],
                    "interval": self.interval, "predictions": [r.to_json() for r in self.predictions], **self.extra})
        if self.png_set:
            out["png"] = self.png
        return out

    @classmethod
    def from_json(cls, doc: Json) -> PlanDocument:
        """A document on paper (:func:`dtrain.explain.paper.plan_on_paper`) as typed records."""
        known = {"run_dir", "what_if", "scaling", "measured", "link", "total_batches", "inputs", "interval",
                 "predictions"}
        measured, inputs, rows = doc["measured"], doc["inputs"], doc["predictions"]
        total = doc.get("total_batches")
        return cls(_text(doc.get("run_dir")), Measured(**_mapping(measured)), _text(doc.get("link")),
                   int(str(total)) if total is not None else None, [Input(**_mapping(i)) for i in _items(inputs)],
                   [_row(_mapping(r)) for r in _items(rows)], what_if=_text(doc.get("what_if")),
                   scaling=_text(doc.get("scaling")), interval=str(doc.get("interval", "80%")),
                   extra={k: v for k, v in doc.items() if k not in known})


def _row(row: Json) -> PlanRow:
    names = set(PlanRow.__dataclass_fields__) - {"extra"}
    return PlanRow(**{k: v for k, v in row.items() if k in names},
                   extra={k: v for k, v in row.items() if k not in names})


def _mapping(value: object) -> Json:
    return dict(value) if isinstance(value, dict) else {}


def _items(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []


def _text(value: object) -> str | None:
    return None if value is None else str(value)


# The row of a change that removes seconds the terms do not see (the loader plan's whole step: advice.loader_priced).
OUTSIDE = "outside the terms"


def explained(model: CostModel, target: Target, less_step: float = 0.0) -> list[dict[str, object]]:
    """``target``'s terms at the run and at the change (:meth:`CostModel.explain`), as ``--json`` writes them;
    with ``less_step``, one more row that takes those seconds off the step."""
    rows = model.explain(target)
    if less_step > 0:
        rows.append(TermValue(OUTSIDE, 0.0, -less_step, 0.0, (Input(
            "the loader plan's step below the terms' rest (its steps timed after the run, or its formula)",
            f"{1e3 * less_step:.3f} ms", PROBED),)))
    return [row.to_json() for row in rows]


def explain_text(terms: list[Json], known: set[tuple[str, str, str]] | None = None, change: bool = True) -> str:
    """``--explain``: each term's seconds at the run and at the change (one standard deviation beside it), and
    each input with where it came from (measured, probed, given, assumed, fitted); ``known``: inputs already
    printed (term, name, value), left out; ``change`` False: the run alone."""
    lines = []
    for term in terms:
        run, there, sd = (float(str(term[k])) for k in ("run_seconds", "target_seconds", "sd_seconds"))
        spread = f" +/- {1e3 * sd:.3f}" if sd > 0 else ""
        lines.append(f"  {term['name']}: {1e3 * run:.3f} ms at the run"
                     + (f", {1e3 * there:.3f}{spread} ms at the change" if change else ""))
        items = term["inputs"] if isinstance(term["inputs"], list) else []
        for i in items:
            if known is None or (str(term["name"]), i["name"], i["value"]) not in known:
                lines.append(f"    {i['name']}: {i['value']} [{i['source']}]")
    run_step = sum(float(str(t["run_seconds"])) for t in terms)
    step = sum(float(str(t["target_seconds"])) for t in terms)
    lines.append(f"  step (the terms added up): {1e3 * run_step:.3f} ms at the run"
                 + (f", {1e3 * step:.3f} ms at the change" if change else ""))
    return "\n".join(lines) + "\n"


def inputs_of(terms: list[Json]) -> set[tuple[str, str, str]]:
    """Every (term, input, value) of ``terms``: what a later row need not print again."""
    return {(str(t["name"]), i["name"], i["value"]) for t in terms
            for i in (t["inputs"] if isinstance(t["inputs"], list) else [])}


def explain_plan(doc: PlanDocument) -> str:
    """``dtrain plan --explain``: each row's terms at the run and at the row; inputs the first row (the run as
    measured, where listed) printed already are not repeated."""
    text, known = f"explained: each row's terms ({MEASURED} on the run, {PROBED} after it, given, assumed)\n", None
    for row in doc.predictions:
        if not row.terms:
            continue
        text += f"{row.slots} slot(s) on {row.nodes} node(s), {row.change}:\n" + explain_text(row.terms, known)
        if row.reason:
            text += f"  {row.reason}\n"
        known = inputs_of(row.terms) | (known or set())
    return text
