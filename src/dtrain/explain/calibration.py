"""The cost model against stored held-out rows, and the fit of its constants from them.

Two kinds of row (``bench/data/plan_rows.json``):

* **published**: a large-scale result from a paper or a vendor's table, and the ``dtrain plan --what-if``
  spec of its inputs (each cited there); the model predicts its samples/s or its scaling efficiency.
* **measured**: a configuration ``bench/plan_accuracy.py --measure`` ran on this host, with the inputs of the
  model it was predicted from (the source run's :class:`~dtrain.explain.facts.Facts`, the local link probe,
  a given link) and its measured ratio to the source configuration, per round. Rows of an older session
  keep only that session's predicted figures (``legacy``): they show that model's error, not this one's.

:func:`fit` sets the terms' constants (least squares on log error) and then the inputs' uncertainties
(maximum likelihood of the log errors, one normal per row with the row's own exposures), each only from
the rows that expose it; :func:`held_out` repeats both with each configuration left out and predicts it,
which is what the accuracy table and the tests report.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from dtrain.explain import fitted, spread
from dtrain.explain.costmodel import CostModel, Link, Prediction, RingLink, Target
from dtrain.explain.facts import Facts
from dtrain.explain.fitted import Fitted
from dtrain.explain.paper import model as paper_model
from dtrain.explain.paper import parse, target
from dtrain.explain.precision import GainCurve

# An uncertainty is fitted only where rows of at least this many configurations expose it (a spread needs
# more than one configuration's errors); a term's constant from any configuration that exposes it.
MIN_CONFIGURATIONS = 2
# Candidate values around a term's current one, relative (log-spaced from a tenth to ten times).
GRID = tuple(10 ** (k / 8) for k in range(-8, 9))
# Candidate relative uncertainties: log-spaced from 0.1% to 100%; every fit starts from FIRST_GUESS, so that
# a re-fit of the same rows returns the same values whatever the file held before.
UNCERTAINTY_GRID = tuple(10 ** (k / 16) for k in range(-48, 1))
FIRST_GUESS = 0.1
JITTER_GRID = tuple(k / 400 for k in range(0, 41))  # 0 .. 10% of a GPU's compute
SHARE_GRID = tuple(k / 100 for k in range(70, 101))  # a share of a link's rate: 70% .. all of it
TERM_GRIDS = {"paper_jitter": JITTER_GRID, "tcp_goodput": SHARE_GRID}


@dataclass(frozen=True, slots=True)
class Row:
    """One held-out row: its configuration (the unit left out together), what it is, and the measurement."""

    config: str
    label: str
    measured: float  # samples/s, efficiency, or ratio to the source configuration
    kind: str  # "published" | "measured"
    spec: str = ""  # published: the --what-if spec
    slots: int = 1
    measure: str = "samples_per_second"  # published: "samples_per_second" | "efficiency"
    source: dict[str, object] | None = None  # measured: Facts.to_json, probe, link, target
    repeat: int = 0  # measured: the bench session (repeat) that measured it; 0 for a published row


@dataclass(frozen=True, slots=True)
class Outcome:
    """A row predicted: the point and 80% interval in the row's measure, the error, and the exposures."""

    row: Row
    predicted: float
    low: float
    high: float
    relative: dict[str, float]  # input name -> exposure over the step (one unit of relative uncertainty)
    fixed: float  # relative standard deviation measured on the run (drift, link fit residual)
    widest: str
    measured_here: bool  # every input measured on this host (no given link, no assumption)

    @property
    def error(self) -> float:
        return self.predicted / self.row.measured - 1

    @property
    def inside(self) -> bool:
        return self.low <= self.row.measured <= self.high


def _scaled(pred: Prediction, value: float) -> tuple[float, float]:
    """The prediction's interval around ``value`` (a figure proportional to its samples/s)."""
    sps = pred.samples_per_second
    return value * pred.samples_per_second_low / sps, value * pred.samples_per_second_high / sps


def _outcome(row: Row, built: CostModel, pred: Prediction, value: float, here: bool) -> Outcome:
    low, high = _scaled(pred, value)
    exposures = spread.exposures(built, pred.target, pred.parts, pred.step)
    sigmas = spread.uncertainties(built, pred.target, pred.parts, pred.step)
    fixed = math.hypot(sigmas.get("drift over the run", 0.0), sigmas.get("link fit residual", 0.0)) / pred.step
    return Outcome(row, value, low, high, {k: v / pred.step for k, v in exposures.items()}, fixed, pred.widest, here)


def predict_row(row: Row) -> Outcome | None:
    """``row`` as the model in force predicts it; None for a measured row stored without its inputs."""
    found = _predicted(row, interval=True)
    if found is None:
        return None
    built, pred, value = found
    here = row.kind != "published" and built.between_hosts is None and pred.target.nodes == 1
    return _outcome(row, built, pred, value, here=here)


def predicted_value(row: Row) -> float | None:
    """``row``'s predicted figure alone (no interval), as the model in force predicts it."""
    if _VALUES is None:
        found = _predicted(row, interval=False)
        return found[2] if found is not None else None
    values = fitted.load()
    key = (id(row), tuple(sorted(values.terms.items())), tuple(sorted(values.uncertainty.items())))
    if key not in _VALUES:
        found = _predicted(row, interval=False)
        _VALUES[key] = found[2] if found is not None else None
    return _VALUES[key]


# Within held_out: each row's figure by the constants it was priced with. The folds refit the same terms from
# mostly the same values, and price the same rows with them again.
_VALUES: dict[tuple[Any, ...], float | None] | None = None


def _predicted(row: Row, interval: bool) -> tuple[CostModel, Prediction, float] | None:
    """The row's model, its prediction and the predicted figure in the row's measure."""
    if row.kind == "published":
        spec = parse(row.spec)
        built, _ = paper_model(spec)
        pred = built.predict(target(spec, row.slots), interval)
        value = pred.samples_per_second
        if row.measure == "efficiency":
            value /= row.slots * built.predict(target(spec, 1), interval=False).samples_per_second
        return built, pred, value
    if row.source is None:
        return None
    built = _model_of(row)
    base = built.predict(built.measured_target(), interval=False)
    pred = built.predict(stored_target(row.source["target"]), interval)
    return built, pred, pred.samples_per_second / base.samples_per_second


def stored_target(record: dict[str, Any]) -> Target:
    """A target as a stored row keeps it (``dataclasses.asdict``), its precision's gain curve included."""
    curve = record.get("precision_curve")
    return Target(**{**record, "precision_curve": GainCurve.from_record(curve) if curve else None})


# A stored row's model, built once: it keeps no fitted constant (the model reads them as it predicts), so the
# fit's thousands of trials reuse it. Keyed by the row's source document, held here so its id stays its own.
_MODELS: dict[int, tuple[dict[str, object], CostModel]] = {}


def _model_of(row: Row) -> CostModel:
    source = row.source
    if source is None:
        raise ValueError(f"{row.label}: a row stored without its inputs has no model")
    found = _MODELS.get(id(source))
    if found is None or found[0] is not source:
        found = _MODELS[id(source)] = (source, model_from_json(source))
    return found[1]


def model_to_json(built: CostModel, target: Target) -> dict[str, object]:
    """What a measured row keeps of the model it was predicted from: the facts, the link and overhead the
    model derived from the run (or from ``dtrain plan --probe``), the link given between hosts, the target."""
    link = built.link
    return {"facts": built.facts.to_json(), "link": [link.step_latency, link.busbw] if link else None,
            "link_source": built.link_source, "link_residual": built.link_residual,
            "between_hosts": asdict(built.between_hosts) if built.between_hosts else None,
            "overhead": built.overhead, "overhead_source": built.overhead_source, "factor": built.factor,
            "contention": built.contention, "exchange_scale": built.exchange_scale,
            "held_exchange": built.held_exchange, "target": asdict(target)}


def model_from_json(data: dict[str, object]) -> CostModel:
    """The inverse of :func:`model_to_json` (the model, without its list of sources)."""
    link, between = data["link"], data["between_hosts"]
    model = CostModel(Facts.from_json(data["facts"]),  # type: ignore[arg-type]
                      RingLink(*link) if isinstance(link, list) else None, str(data["link_source"]),
                      float(data["link_residual"]), Link(**between) if isinstance(between, dict) else None,  # type: ignore[arg-type]
                      float(data["overhead"]), str(data["overhead_source"]), float(data["factor"]),  # type: ignore[arg-type]
                      float(data["contention"]),  # type: ignore[arg-type]
                      exchange_scale=float(data.get("exchange_scale", 1.0)),  # type: ignore[arg-type]
                      held_exchange=float(data.get("held_exchange", 0.0)))  # type: ignore[arg-type]
    if not model.facts.holds_exchange:  # as CostModel.from_facts: a held exchange uses neither
        model.derive_from_facts()
    return model


def evaluate(rows: list[Row]) -> list[Outcome]:
    """Every row that can be predicted, as the model in force predicts it."""
    return [o for o in map(predict_row, rows) if o is not None]


# ------------------------------------------------------------------------------------------- the fit
def _term_rows(rows: list[Row], values: Fitted, name: str) -> list[Row]:
    """Rows whose prediction moves with the term ``name`` near its present value: a term that binds only far
    from it (a shaper's timer on a link whose bucket refills slower than the timer ticks) would otherwise be
    bent to absorb those rows' other errors."""
    value = values.terms[name]
    bumped = replace(values, terms={**values.terms, name: value * 1.25 if value > 0 else 1e-3})
    with fitted.trying(values):
        before = {r.label: predicted_value(r) for r in rows}
    with fitted.trying(bumped):
        after = {r.label: predicted_value(r) for r in rows}
    return [r for r in rows if (b := before[r.label]) is not None and abs((after[r.label] or b) / b - 1) > 1e-6]


def _configurations(rows: list[Row]) -> int:
    return len({system(r) for r in rows})


def _squared_log_error(rows: list[Row], values: Fitted) -> float:
    with fitted.trying(values):
        points = [(predicted_value(r), r.measured) for r in rows]
    return sum(math.log(p / m) ** 2 for p, m in points if p is not None)


def _error_with(rows: list[Row], values: Fitted, name: str, value: float) -> float:
    """:func:`_squared_log_error` of ``rows`` with term ``name`` at ``value``."""
    return _squared_log_error(rows, replace(values, terms={**values.terms, name: value}))


def fit_terms(rows: list[Row], start: Fitted) -> tuple[Fitted, list[str]]:
    """Each term's constant by least squares on the log error of the rows that expose it (one at a time)."""
    values, names = start, []
    for name in sorted(start.terms):
        exposed = _term_rows(rows, values, name)
        if not exposed:
            continue
        grid = TERM_GRIDS.get(name) or tuple(values.terms[name] * g for g in GRID)
        best = _least_on_grid(grid, values.terms[name], functools.partial(_error_with, exposed, values, name))
        values = replace(values, terms={**values.terms, name: best})
        names.append(name)
    return values, names


def _least_on_grid(grid: tuple[float, ...], present: float, cost: Callable[[float], float]) -> float:
    """The value of ``grid`` (ascending) where ``cost`` is least, walking from the one nearest ``present`` to the
    neighbour that costs less until neither does (then to the smallest of a flat floor, as :func:`min` over the
    whole grid would pick). One term's error over the rows that expose it has a single valley: the walk prices the few
    values between the present one and the least where a sweep priced every one (a held-out table refits each
    term once per configuration left out; tests/explain/test_plan_accuracy.py compares the two)."""
    prices: dict[int, float] = {}

    def price(i: int) -> float:
        if i not in prices:
            prices[i] = cost(grid[i])
        return prices[i]

    at = min(range(len(grid)), key=lambda i: abs(grid[i] - present))
    while True:  # down the valley, to the cheaper side
        left = price(at - 1) if at > 0 else math.inf
        right = price(at + 1) if at + 1 < len(grid) else math.inf
        if left < price(at) and left <= right:
            at -= 1
        elif right < price(at):
            at += 1
        else:
            break
    while at > 0 and price(at - 1) == price(at):  # a flat floor: its smallest value, as min() picks
        at -= 1
    return grid[at]


def fit_uncertainties(rows: list[Row], start: Fitted) -> tuple[Fitted, list[str]]:
    """Each input's relative uncertainty by maximum likelihood of the rows' log errors (coordinate descent on
    a log grid), for the inputs that rows of at least two configurations expose.

    A row's log error is normal with variance ``fixed^2 + sum_k (u_k x_k)^2`` (``x_k``: its exposure to input
    ``k``); each coordinate step prices every grid value at once, as arrays (held-out tables refit this once
    per configuration)."""
    with fitted.trying(start):
        outcomes = evaluate(rows)
    names = [k for k in sorted(start.uncertainty)
             if _configurations([o.row for o in outcomes if o.relative.get(k, 0.0) > 1e-3]) >= MIN_CONFIGURATIONS]
    u = {**start.uncertainty, **dict.fromkeys(names, FIRST_GUESS)}
    keys = sorted(u)
    exposed2 = np.array([[o.relative.get(k, 0.0) ** 2 for k in keys] for o in outcomes]).reshape(len(outcomes),
                                                                                               len(keys))
    fixed2 = np.array([o.fixed ** 2 for o in outcomes])
    error2 = np.array([math.log(o.predicted / o.row.measured) ** 2 for o in outcomes])
    grid2 = np.array(UNCERTAINTY_GRID) ** 2
    for _ in range(6):
        for k in names:
            j = keys.index(k)
            others = np.array([0.0 if i == j else u[key] ** 2 for i, key in enumerate(keys)])
            variance = (fixed2 + exposed2 @ others)[:, None] + exposed2[:, j:j + 1] * grid2[None, :]
            nll = (0.5 * np.log(variance) + error2[:, None] / (2 * variance)).sum(axis=0)
            u[k] = UNCERTAINTY_GRID[int(np.argmin(nll))]
    return replace(start, uncertainty=u), names


def fit(rows: list[Row], start: Fitted) -> tuple[Fitted, list[str]]:
    """Terms, then uncertainties, from ``rows``; the second: the names the rows fitted."""
    values, terms = fit_terms(rows, start)
    values, uncertain = fit_uncertainties(rows, values)
    return values, terms + uncertain


def system(row: Row) -> str:
    """The configuration a row belongs to, for leaving it out: a published system's rows all together (BART's
    four tables share their source and links: leaving one in would let it vouch for the others)."""
    return row.config.split(":")[0]


def held_out(rows: list[Row], start: Fitted) -> list[Outcome]:
    """Each configuration predicted by constants fitted without it (leave one configuration out)."""
    global _VALUES
    out: list[Outcome] = []
    _VALUES = {}
    try:
        for config in sorted({system(r) for r in rows}):
            values, _ = fit([r for r in rows if system(r) != config], start)
            with fitted.trying(values):
                out += evaluate([r for r in rows if system(r) == config])
    finally:
        _VALUES = None
    return out


@dataclass(frozen=True, slots=True)
class Summary:
    """Mean and worst absolute error, the share of rows inside their interval, the widest interval."""

    rows: int
    mean_error: float
    worst_error: float
    covered: float
    widest_half_width: float  # the largest (high / point - 1) or (1 - low / point), relative

    @classmethod
    def of(cls, outcomes: list[Outcome]) -> Summary:
        errors = [abs(o.error) for o in outcomes]
        return cls(len(outcomes), statistics.mean(errors) if errors else 0.0, max(errors, default=0.0),
                   sum(o.inside for o in outcomes) / len(outcomes) if outcomes else 0.0,
                   max((max(o.high / o.predicted - 1, 1 - o.low / o.predicted) for o in outcomes), default=0.0))


def rows_from_json(document: dict[str, list[dict[str, object]]]) -> list[Row]:
    """The stored rows (``bench/data/plan_rows.json``) that the model can predict: published and measured."""
    published = [Row(str(r["config"]), str(r["label"]), float(str(r["measured"])), "published", spec=str(r["spec"]),
                     slots=int(str(r["slots"])), measure=str(r["measure"])) for r in document["published"]]
    measured = [Row(str(r["config"]), str(r["label"]), statistics.median(r["rounds"]), "measured",  # type: ignore[arg-type]
                    source=r["source"], repeat=int(str(r.get("repeat", 0))))  # type: ignore[arg-type]
                for r in document["measured"]]
    return published + measured


def other_host(document: dict[str, Any], constants: Fitted) -> list[Outcome]:
    """The rows of ``document['other_host']`` (a repeat measured on another host, never fitted) predicted with
    ``constants``: do constants fitted on one host hold on another?"""
    rows = rows_from_json({"published": [], "measured": document.get("other_host", [])})
    with fitted.trying(constants):
        return evaluate(rows)


def with_values(document: dict[str, dict[str, dict[str, object]]], values: Fitted,
                names: list[str]) -> dict[str, dict[str, dict[str, object]]]:
    """``fitted_intervals.json``'s document with ``values``; ``names`` marked fitted, the rest as they were."""
    out = {key: dict(table) if isinstance(table, dict) else table for key, table in document.items()}
    for key, table in (("uncertainty", values.uncertainty), ("terms", values.terms)):
        for name, value in table.items():
            entry = dict(out[key][name])
            entry["value"] = round(value, 6)
            if name in names:
                entry["source"] = "fitted (bench/data/plan_rows.json, leave-one-configuration-out)"
            out[key][name] = entry
    return out
