"""The doctor: turns a run's measured step profile into ranked factors and concrete config changes.

Model. A synchronous step on every rank is its data wait + its compute + its exposed communication, and
all ranks finish a step together. From ``profile.json`` the step is split into parts that add up to it:

* ``data_loading``   mean data wait (the cost model's data term at the run)
* ``compute``        forward + backward: the cost model's compute term at the run (the work every slot must do)
* ``batch_size``     per-step fixed costs (optimizer step, bookkeeping: the model's fixed term): they do
                     not grow with the batch, so a bigger batch amortizes them
* ``communication``  exposed all-reduce time of the slowest rank (it waits least for peers), the part
                     that moves bytes (bandwidth-bound)
* ``sync_frequency`` the same exposed time's per-message part (buckets x measured one-float latency):
                     a cost paid per synchronization, which only syncing less often removes
* ``straggler``      the remainder: time ranks spend waiting for the slowest rank
* ``precision``      the part of the compute a lower precision saves, as the model's own steps timed in it
                     at the end of the run measured it; where only matmul peaks were measured, the change
                     is named with an upper bound and no prediction (:mod:`dtrain.explain.precision`).

Each factor's action is predicted from the same numbers (e.g. aggregation_frequency k divides the
communication and waiting by k). Predictions assume the other parts stay as measured. The advice is held
to what it can deliver: a change predicted within 2% of today is not advised (nor, on one slot, anything
about exchanging gradients); a rank is named, with what to check on its host, only when it is chronically
last (``stragglers.chronic_rank``); and one change has one predicted speed-up wherever it appears (one
slot: the scaling estimate's; more loader workers: one loader plan).

The doctor diagnoses only phases it saw: a trial that calls ``loss.backward()`` / ``opt.step()`` itself
leaves them in ``other`` (``profile.json``'s ``unobserved_phases``), and then gets one line saying so, the
measured data wait and the rest of the step, and no change or prediction.

Each factor is one module of :mod:`dtrain.explain.factors`, found through its registry; every predicted gain
is one :class:`~dtrain.explain.predictor.Predictor` call on the cost model ``dtrain plan`` uses.
"""
from __future__ import annotations

from dtrain.explain import advice, scriptadvice
from dtrain.explain.diagnosis import (
    Advice,
    Diagnosis,
    FactorRow,
    Json,
    Recommendation,
    Scaling,
    TryResult,
    config_text,
    slot_words,
)
from dtrain.explain.efficiency import Efficiency
from dtrain.explain.exchange import Unpriced
from dtrain.explain.factors import registry
from dtrain.explain.factors.base import ONE_SLOT, Context, build_context, gains
from dtrain.explain.facts import exchange_kind
from dtrain.explain.goodput import duration
from dtrain.explain.predictor import Predictor, too_wide
from dtrain.explain.render import interval, ratio
from dtrain.profiling.record import SERVER, ProfileRecord

# A factor's change is recommended only where the factor holds at least this share of the step.
MIN_SHARE = 0.05


def unobserved_note(profile: ProfileRecord) -> str:
    """One line: which phases the run did not see and why (its trial calls loss.backward() / opt.step()),
    and the fix; empty when every phase was seen."""
    missing = profile.unobserved_phases or []
    if not missing:
        return ""
    if profile.script is not None and profile.script.unseen:  # a script's run: what could not be seen, as it says
        return f"the step's {', '.join(missing)} was not observed: {profile.script.unseen[0]}"
    calls = [c for c, phase in (("self.context.backward(loss)", "forward"),
                                ("self.context.step_optimizer(opt)", "optimizer")) if phase in missing]
    raw = [c for c, phase in (("loss.backward()", "forward"), ("opt.step()", "optimizer")) if phase in missing]
    return (f"the step's phases were not observed: train_batch calls {' / '.join(raw)} itself, not "
            f"{' / '.join(calls)}, so {', '.join(missing)} are counted in 'other'; call {' and '.join(calls)} "
            "for a diagnosis")


def _unobserved_diagnosis(profile: ProfileRecord) -> Diagnosis:
    """A step whose phases were not all seen: only what was measured whatever train_batch does (the step and
    the wait for its batch), and no factor, change or prediction built on the phases not seen."""
    ranks = [r.seconds_per_step for r in profile.per_rank]
    step = sum(r.step for r in ranks) / len(ranks)
    data = min(r.data for r in ranks)
    rest = max(0.0, step - data)
    missing = list(profile.unobserved_phases or [])
    factors = [
        FactorRow("data_loading", data / step, data, Advice(
            None, None, "the wait for the next batch, measured before train_batch whatever it calls", None)),
        FactorRow("train_batch", rest / step, rest, Advice(
            None, None, f"not split into phases ({', '.join(missing)} not observed)", None)),
    ]
    factors.sort(key=lambda f: f.seconds_per_step, reverse=True)
    found = Diagnosis(profile.slots, profile.samples_per_second, step, None, False, unobserved_note(profile), factors,
                      [], Scaling(None, False), unobserved_phases=missing, efficiency=Efficiency.of(profile))
    scriptadvice.attach(found, profile)
    return found


def diagnose(profile: ProfileRecord, predictor: Predictor | None = None) -> Diagnosis:
    """Ranked factors, recommendations and a verdict. ``predictor``: the cost model to ask (``dtrain plan``'s
    for the same run gives the same figures); by default the run's own. A profile whose step phases were not
    all observed gets no diagnosis of them (:func:`unobserved_note` says why)."""
    if not profile.phases_observed:
        return _unobserved_diagnosis(profile)
    predictor = predictor if predictor is not None else Predictor(profile)
    ctx = build_context(profile, predictor)
    rows = []
    for factor in registry.factors():
        found = factor.advise(ctx)
        _worth_it(found)
        seconds = factor.seconds(ctx)
        rows.append(FactorRow(factor.name, seconds / ctx.step, seconds, found))
    for name, seconds in ctx.others.items():  # a cost-model term no factor splits: its own row (explain/terms/)
        rows.append(FactorRow(name, seconds / ctx.step, seconds, Advice(
            None, None, f"the cost model's {name} term at the run (dtrain doctor --explain lists its inputs)", None)))
    rows.sort(key=lambda r: r.seconds_per_step, reverse=True)  # stable: the registry's order breaks ties
    recommendations = _recommendations(rows, ctx)
    for row in rows:
        if row.key is not None and row.advice.action in predictor.intervals:
            row.predicted_interval = predictor.intervals[row.advice.action]
    for rec in recommendations:
        rec.predicted_interval = predictor.intervals.get(rec.action)
    top = rows[0]
    verdict = _verdict(top, ctx.scaling, profile, rows)
    if predictor.unpriced is not None:
        verdict += f"; {_unpriced_note(predictor.unpriced)}"
    found = Diagnosis(profile.slots, profile.samples_per_second, ctx.step, top.factor, True, verdict, rows,
                      recommendations, ctx.scaling, efficiency=Efficiency.of(profile),
                      workers_only=exchange_kind(profile) == SERVER)
    scriptadvice.attach(found, profile)  # a script's run: what only a script shows, and what to try from outside
    return found


def _unpriced_note(found: Unpriced) -> str:
    """What the doctor does not predict for this run, and why (one clause)."""
    return found.message(found.changes) + found.aside


def _recommendations(rows: list[FactorRow], ctx: Context) -> list[Recommendation]:
    """Every change that gains more than 2%, from a factor holding at least 5% of the step, best first, one
    entry per change; fewer slots first where one slot is predicted faster (tied, the scaling entry is kept)."""
    scaling = ctx.scaling
    candidates = [Recommendation("scaling", ONE_SLOT[0], ONE_SLOT[1], scaling.estimated_one_slot_speedup or 0.0,
                                 predicted_interval=_one_slot_interval(scaling))
                  ] if scaling.slower_than_one_slot else []
    candidates += [Recommendation(r.factor, r.key, r.value, r.predicted_speedup,
                                  predicted_interval=r.predicted_interval) for r in rows
                   if r.key is not None and r.predicted_speedup is not None and r.share >= MIN_SHARE]
    ranked = sorted((r for r in candidates if gains(r.predicted_speedup)), key=lambda r: r.predicted_speedup,
                    reverse=True)
    seen: set[str] = set()
    out = []
    for rec in ranked:  # two factors can point at the same change: the best-ranked is kept
        if rec.action not in seen:
            seen.add(rec.action)
            out.append(rec)
    return out


def add_checkpoint_advice(diagnosis: Diagnosis, finish: Json | None) -> None:
    """Add the goodput model's ``min_checkpoint_period`` advice (:mod:`dtrain.explain.goodput`) to a diagnosis:
    a recommendation with its predicted time saving, and ``finish`` (time and cost to finish) as is."""
    diagnosis.finish, diagnosis.finish_asked = finish, True
    found = finish.get("advice") if finish else None
    if isinstance(found, dict) and found:
        diagnosis.recommendations.append(Recommendation("checkpoints", str(found["key"]), found["value"],
                                                        float(found["predicted_speedup"]), why=str(found["why"])))
        diagnosis.recommendations.sort(key=lambda r: r.predicted_speedup, reverse=True)


def _worth_it(found: Advice) -> None:
    """Drop a change predicted to gain less than ``MIN_GAIN`` (the alternative takes its place if it gains):
    the row keeps its share and its why, and says why nothing is to try. A change known only by its bound
    is kept while the bound allows a gain."""
    alt = found.alternative
    if alt is not None and not gains(alt.predicted_speedup):
        found.alternative = alt = None
    if found.key is None or gains(found.predicted_speedup) or gains(found.bound):
        return
    speedup = found.predicted_speedup
    if speedup is not None:
        found.why += (f"; {found.action} is predicted at {speedup:.2f}x, "
                      f"{'no faster than' if speedup < 1 else 'within 2% of'} today: not worth a change")
        found.declined = True
    if alt is not None:
        found.key, found.value, found.predicted_speedup = alt.key, alt.value, alt.predicted_speedup
        found.alternative = None
    else:
        found.key, found.value, found.predicted_speedup, found.bound = None, None, None, None


def _verdict(row: FactorRow, scaling: Scaling, profile: ProfileRecord, rows: list[FactorRow]) -> str:
    top = row.factor
    lead = f"{top.replace('_', ' ')} is the top factor ({100 * row.share:.0f}% of the step)"
    fewer = scaling.slower_than_one_slot
    # The one-slot change is stated once, in the scaling sentence below, with its one figure.
    change = (row.key is not None and row.predicted_speedup is not None
              and not (fewer and (row.key, row.value) == ONE_SLOT))
    if top == "straggler":  # who, or that ranks take turns (then there is nothing to try)
        late = row.advice.straggler
        fixed = late.fixed_speedup if late is not None else None
        finding, fallback = advice.split_fallback(row.why)
        lead += f": {finding}"
        if fixed:
            between = f" ({late.fixed_interval[0]:.1f}-{late.fixed_interval[1]:.1f})" if late.fixed_interval else ""
            lead += f"; fixing it: about {fixed:.1f}x samples/s{between}"
        if change:
            lead += f"; {row.key}: {row.value}: about {row.predicted_speedup:.1f}x"
        if fallback and not (fewer and f"{ONE_SLOT[0]}: {ONE_SLOT[1]}" in fallback):  # said once, below
            lead += f". {fallback}"
    elif change and row.predicted_interval is not None and too_wide(row.predicted_speedup, *row.predicted_interval):
        # no point figure where the model cannot price it (issue 73)
        lead += f": try {row.key}: {row.value}, {_unpriced(row.predicted_interval)}"
    elif change:
        between = f" ({interval(row.predicted_interval)})" if row.predicted_interval is not None else ""
        lead += f": try {row.key}: {row.value}, predicted about {row.predicted_speedup:.1f}x samples/s{between}"
    # A change known only by its bound (a lower precision, where only matmul peaks were measured; a bigger batch
    # of a model not timed at twice its batch) is named for a compute-bound step, with the bound, never advised.
    bounded = next((r for r in rows if r.key is not None and r.advice.bound is not None), None)
    if bounded is not None and top in ("compute", bounded.factor):
        why = BOUND_WHY.get(bounded.factor, "")
        lead += (f"; {bounded.key}: {bounded.value} gives at most {bounded.advice.bound:.1f}x samples/s (a bound, "
                 f"not a prediction{why})")
    if fewer:
        one = scaling.estimated_one_slot_speedup or 0.0
        late = row.advice.straggler if top == "straggler" else None
        chronic = late if late is not None and late.chronic else None
        waiting = f"waiting for rank {chronic.rank}, " if chronic else ""
        # Where the cost model measured its wait (its fix priced with an interval), one slot leaves the rank out.
        left_out = f", leaving rank {chronic.rank} out" if chronic and chronic.fixed_interval is not None else ""
        slower = (f"{profile.slots} slots are SLOWER than 1 would be here (estimated "
                  f"{scaling.estimated_speedup_vs_one_slot or 0.0:.2f}x of one slot): {waiting}communication and "
                  f"{_cpus(profile)} cost more than they buy; use resources.slots_per_trial: 1 "
                  f"({_one_slot_gain(one, scaling)}{left_out}) or make each step bigger")
        # The best change first, as the recommendations rank them: a loading straggler's fix can gain more than
        # dropping to one slot.
        if change and row.predicted_speedup is not None and row.predicted_speedup > one:
            return f"{lead}. As the run is, {slower}"
        lead = f"{slower}. Then: {lead}"
    return lead


def _one_slot_interval(scaling: Scaling) -> tuple[float, float] | None:
    """One slot's gain's 80% interval (Scaling holds N slots' speed-up over one slot's)."""
    speedup = scaling.estimated_speedup_vs_one_slot_interval
    if speedup is None or min(speedup) <= 0:
        return None
    return 1 / speedup[1], 1 / speedup[0]


def _one_slot_gain(one: float, scaling: Scaling) -> str:
    """One slot's gain as the verdict states it: with its 80% interval, or, where that is wider than +/-25%, the
    interval alone and the command that measures it (no point figure the model cannot price; issue 73)."""
    bounds = _one_slot_interval(scaling)
    if bounds is None:
        return f"about {one:.2f}x samples/s"
    if too_wide(one, *bounds):
        return _unpriced(bounds)
    return f"about {one:.2f}x samples/s, {interval(bounds)}"


def _unpriced(bounds: tuple[float, float]) -> str:
    """A change whose 80% interval is wider than +/-25%: the interval alone, and the command that measures it."""
    low, high = bounds
    return f"predicted {low:.2f}-{high:.2f}x samples/s, wider than +/-25%: dtrain doctor --verify measures it"


# Why a factor's change is known only by its bound (the verdict's words).
BOUND_WHY = {"precision": ": only the matmul share of a step speeds up",
             "batch_size": ": the model was not timed at twice its batch, and none of its work growing is the top"}


def _cpus(profile: ProfileRecord) -> str:
    """'2 slots x 1 thread on 2 CPU cores' (cores as the run recorded them)."""
    slots, threads = profile.slots, profile.threads_per_slot
    cores = advice.usable_cores(profile)
    where = f" on {cores} CPU core(s)" + (" per host" if profile.hosts > 1 else "") if cores else ""
    return f"{slots} slots x {threads} thread(s){where}"


def render(diagnosis: Diagnosis) -> str:
    """The doctor's table as text (rich), for the terminal and the end-of-run summary."""
    from rich.table import Table

    from dtrain.explain.render import as_text

    table = Table(title=f"dtrain doctor: {slot_words(diagnosis.slots, diagnosis.workers_only)}, "
                        f"{diagnosis.samples_per_second:,.0f} samples/s, step {1e3 * diagnosis.step_seconds:.2f} ms")
    for col in ("factor", "share", "ms/step", "try", "predicted (80%)"):
        table.add_column(col, justify="right" if col in ("share", "ms/step", "predicted (80%)") else "left")
    for f in diagnosis.factors:
        action = f"{f.key}: {f.value}" if f.key else "-"
        table.add_row(f.factor, f"{100 * f.share:.0f}%", f"{1e3 * f.seconds_per_step:.2f}", action, _predicted(f))
    # Why, in the user's terms (learning-rate rule, what to check on a host), for the factors with a change.
    # The straggler's too, with no change: it says that ranks take turns, or why one slot fewer would not help;
    # and a factor whose change was declined: a large share with nothing to try says why (a loader process
    # that would slow the run).
    notes = "".join(f"  {f.factor}: {f.why}\n" for f in diagnosis.factors[:4]
                    if (f.key or f.factor == "straggler" or f.advice.declined) and f.share >= MIN_SHARE)
    checkpoints = next((r for r in diagnosis.recommendations if r.factor == "checkpoints"), None)
    extra = (f"checkpoints: {checkpoints.action} (predicted {checkpoints.predicted_speedup:.2f}x less time to "
             f"finish): {checkpoints.why}\n") if checkpoints else _finish_text(diagnosis)
    tries = "".join(f"try {t.change}: {_try_text(t)}\n" for t in diagnosis.tries)
    lines = "".join(f"{line}\n" for line in diagnosis.efficiency.lines)
    return (as_text(table) + f"verdict: {diagnosis.verdict}\n" + extra + (f"why:\n{notes}" if notes else "")
            + scriptadvice.text(diagnosis) + tries + lines)


def _finish_text(diagnosis: Diagnosis) -> str:
    """``--mttf`` without advice: why the checkpoint period stays, and the finish it gives."""
    if not diagnosis.finish_asked:
        return ""
    found = diagnosis.finish
    if not found or not found.get("configured"):
        return ("checkpoints: no advice: the run's length is not known (max_length in batches or epochs, and the "
                "run's summary.json)\n")
    conf = found["configured"]
    period = conf["period_batches"]
    kept = f"min_checkpoint_period {config_text({'batches': period})}" if period else "a checkpoint only at the end"
    cost = f", ${conf['cost']:,.4g} in all" if conf.get("cost") is not None else ""
    return (f"checkpoints: keep {kept}: no period finishes 2% sooner (Young/Daly: every "
            f"{found.get('daly_period_batches') or 0:,} batches at a failure every {found['system_mttf_hours']:g} h); "
            f"to finish {duration(conf['seconds'])}, {conf['failures']:.2g} failures expected, goodput "
            f"{100 * conf['goodput']:.1f}%{cost}\n")


def _predicted(f: FactorRow) -> str:
    if f.predicted_speedup:
        text = f"{ratio(f.predicted_speedup)}x"
        if f.predicted_interval is not None:
            low, high = f.predicted_interval
            if too_wide(f.predicted_speedup, low, high):  # no point figure: --verify measures it (issue 73)
                return f"{ratio(low)}-{ratio(high)}x, wide: --verify"
            text += f" ({ratio(low)}-{ratio(high)})"
        return text
    if f.key is not None and f.advice.bound is not None:
        return f"<= {f.advice.bound:.2f}x (bound)"
    return "-"


def _try_text(t: TryResult) -> str:
    if t.gain is None or t.samples_per_second is None:
        return t.reason or "no prediction"
    return (f"predicted {t.samples_per_second:,.0f} samples/s, {ratio(t.gain)}x ({ratio(t.low)}-{ratio(t.high)}, 80%)"
            + (f"; {t.reason}" if t.reason else ""))
