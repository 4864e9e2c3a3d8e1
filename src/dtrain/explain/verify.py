"""``dtrain doctor RUN_DIR --verify``: measure the doctor's advice instead of trusting it.

The doctor predicts each recommendation's speed-up from one profile. Here each of its top
recommendations, and two bisection experiments, runs as a short training of the same trial on the same
slots with the run's resolved config patched (``--set``-style overrides, in-process as ``dtrain bench``
does), beside a baseline of the unpatched config measured in the same session:

* bisection, communication off: ``optimizations.aggregation_frequency`` = the step count (one exchange
  in the whole short run), the ceiling of any communication fix (Determined's advice, automated);
* bisection, data loading off: ``data_loader.synthetic: true`` (one batch reused), the ceiling of any
  loader fix.

Each experiment's measured speed-up is the median, over rounds, of its samples/s over the baseline's
measured in the *same* round (steady state, from each short run's ``profile.json``), beside the range
of those ratios (:mod:`dtrain.explain.paired`): a shared machine drifts between rounds, and a ratio of
two medians taken from different rounds misleads. The baseline runs first in every round; the other
experiments run in reverse order in odd rounds, so drift within a round hits all alike. With a round
budget (``max_repeats``) rounds are added until every range is no wider than ``target_spread``. The
recommendation with the best paired median that beats the baseline is written as ``RUN_DIR/tuned.yaml``:
the run's full config with that one change (for a bigger batch, with the learning rate rescaled when the
config names it, as the doctor says).

With ``--try KEY=VALUE`` (:func:`verify_tries`) exactly the tried changes run instead, each as given (a bigger
batch keeps the config's learning rate: throughput does not depend on it), in the same paired rounds; each row
holds the prediction with its 80% interval (as ``doctor --try`` gives it), the measured median and range, the
point's error and whether the interval held the measured median. No ``tuned.yaml`` is written.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.errors import UserError
from dtrain.explain import paired
from dtrain.explain.diagnosis import Diagnosis, TryResult, slot_words
from dtrain.explain.facts import exchange_kind
from dtrain.explain.predictor import Predictor
from dtrain.explain.render import ratio
from dtrain.profiling.record import SERVER, SHARDED, ProfileRecord, load_profile, load_run_profile

MIN_STEPS = 10
# Seconds of training each short run measures at least (steps are raised to reach it).
MIN_SECONDS = 2.0


@dataclass
class Experiment:
    """One short run: ``sets`` on top of the run's config."""

    action: str
    kind: str  # "baseline" | "recommendation" | "bisection"
    sets: list[str]
    predicted_speedup: float | None = None
    factor: str | None = None
    samples_per_second: list[float] = field(default_factory=list)

    @property
    def measured(self) -> float | None:
        return paired.median(self.samples_per_second)


def plan_experiments(diagnosis: Diagnosis, profile: ProfileRecord, steps: int, top: int,
                     predictor: Predictor | None = None) -> list[Experiment]:
    """Baseline, the doctor's first ``top`` recommendations, and the two bisection experiments, each with its
    prediction from the doctor's cost model (``predictor``: the one the diagnosis asked; by default the run's)."""
    from dtrain.explain.advice import batch_change

    predictor = predictor if predictor is not None else Predictor(profile)
    out = [Experiment("baseline", "baseline", [])]
    if not profile.synthetic_data:  # right after its baseline: the smallest ceiling is the most drift-prone
        # No wait for data at all: the ceiling of any loader fix.
        out.append(Experiment("bisection: data loading off (synthetic data)", "bisection",
                              ["data_loader.synthetic=true"], predictor.gain("data_loader.synthetic: true",
                                                                             data_workers_step=0.0), "data_loading"))
    for rec in diagnosis.recommendations[:top]:
        sets = [f"{rec.key}={_yaml(rec.value)}"]
        if rec.key == "hyperparameters.global_batch_size":
            sets += batch_change(profile, int(str(rec.value))).sets
        out.append(Experiment(rec.action, "recommendation", sets, rec.predicted_speedup, rec.factor))
    # A sharded run keeps its all-gathers in every forward and backward whatever the period: aggregation turns
    # off its reduce-scatters only, which is no ceiling of a communication fix.
    if profile.slots > 1 and profile.aggregation_frequency < steps and exchange_kind(profile) != SHARDED:
        out.append(Experiment("bisection: communication off (aggregation_frequency = steps)", "bisection",
                              [f"optimizations.aggregation_frequency={steps}"],
                              predictor.gain(f"optimizations.aggregation_frequency: {steps}", aggregation=steps),
                              "communication"))
    return out


def _threads(exp: Experiment, threads: int | None) -> int | None:
    """The session's thread count, or the launcher's rule for a change of slot count."""
    from dtrain.launcher import cpu

    for item in exp.sets:
        key, _, value = item.partition("=")
        if key == "resources.slots_per_trial" and value.isdigit():
            return cpu.for_bench(int(value))[0]
    return threads


def _yaml(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _short_run(config: Path, exp: Experiment, steps: int, out: Path, debug: bool, threads: int | None) -> float:
    from dtrain.launcher import runs

    sets = [*exp.sets, f"max_length={{batches: {steps}}}", "min_validation_period=null",
            "min_checkpoint_period=null", f"scheduling_unit={steps}", "profiling.enabled=true",
            "profiling.probes=false"]  # only the samples/s is read: the probes would lengthen every round
    plan = runs.prepare(config, sets, run_dir=out, resume=None)
    failure = runs.execute(plan, quiet=True, debug=debug, threads=_threads(exp, threads))
    if failure is not None:
        raise UserError(f"--verify: {exp.action} failed on rank {failure.rank}: {failure.message} "
                        f"(logs in {out / 'logs'})")
    return load_profile(out / "profile.json").samples_per_second


@dataclass
class Session:
    """What every short run of one ``--verify`` session shares: the run as profiled and the doctor's view of it,
    the steps per short run (raised to last :data:`MIN_SECONDS`), the round budget and the thread count."""

    run_dir: Path
    profile: ProfileRecord
    predictor: Predictor
    diagnosis: Diagnosis
    steps: int
    budget: int
    threads: int | None


def open_session(run_dir: Path, steps: int, repeats: int, max_repeats: int | None, target_spread: float,
                 log: Any) -> Session:
    """Check the options and the run, and size the short runs (:class:`UserError` where they cannot be run)."""
    from dtrain.explain.doctor import diagnose

    if steps < MIN_STEPS:
        raise UserError(f"--steps {steps}: a verification run needs at least {MIN_STEPS} steps (the first few are "
                        "warm-up, left out of samples/s)")
    budget = paired.check_rounds(repeats, max_repeats, target_spread)
    profile = load_run_profile(run_dir)
    if not profile.phases_observed:  # nothing to verify: the doctor made no recommendation it could stand by
        from dtrain.explain.doctor import unobserved_note

        raise UserError(f"dtrain doctor --verify cannot test {run_dir}: {unobserved_note(profile)}")
    predictor = Predictor(profile)
    diagnosis = diagnose(profile, predictor)
    # Long enough to outlast a burst of other work on a shared machine: a few dozen short steps are not.
    needed = math.ceil(MIN_SECONDS / max(diagnosis.step_seconds, 1e-9))
    if needed > steps:
        log(f"dtrain doctor --verify: {needed} steps per run instead of {steps}, to measure at least "
            f"{MIN_SECONDS:g} s of training each")
        steps = needed
    from dtrain.launcher import cpu

    # One thread rule for the whole session, as the run's own launch applied it.
    threads = cpu.for_bench(_local_processes(run_dir, profile))[0]
    return Session(run_dir, profile, predictor, diagnosis, steps, budget, threads)


def _local_processes(run_dir: Path, profile: ProfileRecord) -> int:
    """Processes per host of the run: its slots, and a parameter server's servers beside its workers (the
    profile counts the workers only; the launcher shares the cores among all of them)."""
    slots = profile.slots
    if exchange_kind(profile) == SERVER:
        from dtrain.config.schema import load_config

        slots = load_config(run_dir / "config.yaml", []).resources.slots_per_trial
    return max(1, slots // profile.hosts)


def measure(session: Session, experiments: list[Experiment], repeats: int, target_spread: float, debug: bool,
            log: Any, run: Any = None) -> tuple[int, Path]:
    """Run ``experiments`` (the baseline first) in paired rounds; returns (rounds run, the session's folder).
    ``run(experiment, folder)``: one short run's samples/s (default: the trial's config patched; a script's run
    passes its own, :mod:`dtrain.explain.scriptverify`)."""
    folder = session.run_dir / f"verify-{time.strftime('%Y%m%d-%H%M%S')}"
    config = session.run_dir / "config.yaml"
    base = experiments[0]
    planned = str(repeats) if session.budget == repeats else f"{repeats}-{session.budget}"
    rounds = 0
    while paired.more_rounds(rounds, repeats, session.budget, [_ratios(e, base) for e in experiments[1:]],
                             target_spread):
        for i, exp in paired.order(list(enumerate(experiments)), rounds, keep_first=True):
            log(f"dtrain doctor --verify: [{rounds + 1}/{planned}] {exp.action} ...")
            out = folder / f"r{rounds}-{i:02d}"
            exp.samples_per_second.append(run(exp, out) if run is not None else
                                          _short_run(config, exp, session.steps, out, debug, session.threads))
        rounds += 1
    return rounds, folder


def measured_figures(exp: Experiment, base: Experiment, target_spread: float) -> dict[str, Any]:
    """``exp``'s paired figures for ``--json``: the median of its per-round ratios over the baseline, their
    range and spread, and its own samples/s."""
    ratios = _ratios(exp, base)
    figures = paired.summary(ratios, target_spread)
    return {"measured_speedup": figures["median"], "speedup_ratios": ratios, "speedup_range": figures["range"],
            "spread": figures["spread"], "narrow": figures["narrow"], "spread_verdict": figures["spread_verdict"],
            "samples_per_second": exp.measured, "samples_per_second_runs": exp.samples_per_second}


def session_json(session: Session, repeats: int, rounds: int, target_spread: float, base: Experiment,
                 folder: Path) -> dict[str, Any]:
    """The ``--json`` fields every verify session has: what ran, how often, and the baseline's figures."""
    return {"run_dir": str(session.run_dir), "steps": session.steps, "repeats": repeats,
            "max_repeats": session.budget, "rounds": rounds, "target_spread": target_spread,
            "median_confidence": paired.median_confidence(rounds), "noise": paired.noise(rounds),
            "slots": session.profile.slots, "workers_only": exchange_kind(session.profile) == SERVER,
            "baseline_samples_per_second": base.measured or 0.0,
            "baseline_runs": base.samples_per_second, "session_dir": str(folder)}


def verify(run_dir: Path, steps: int, repeats: int = 1, top: int = 3, debug: bool = False,
           log: Any = print, max_repeats: int | None = None,
           target_spread: float = paired.DEFAULT_TARGET_SPREAD) -> dict[str, Any]:
    """Run every experiment in rounds (``repeats``, then more up to ``max_repeats`` while a ratio's range is
    wider than ``target_spread``), write ``tuned.yaml`` when a change beats the baseline; returns the
    ``--json`` document."""
    session = open_session(run_dir, steps, repeats, max_repeats, target_spread, log)
    experiments = plan_experiments(session.diagnosis, session.profile, session.steps, top, session.predictor)
    base = experiments[0]
    rounds, folder = measure(session, experiments, repeats, target_spread, debug, log)
    rows = [{"action": e.action, "kind": e.kind, "factor": e.factor, "sets": e.sets,
             "predicted_speedup": e.predicted_speedup, **measured_figures(e, base, target_spread)}
            for e in experiments[1:]]
    rows.sort(key=lambda r: r["measured_speedup"] or 0.0, reverse=True)
    tuned = _write_tuned(run_dir, run_dir / "config.yaml", rows)
    return {**session_json(session, repeats, rounds, target_spread, base, folder), "verified": rows,
            "tuned_config": str(tuned) if tuned else None}


def _ratios(exp: Experiment, base: Experiment) -> list[float]:
    """``exp``'s samples/s over the baseline's, round by round."""
    return paired.ratios(exp.samples_per_second, base.samples_per_second)


def _write_tuned(run_dir: Path, config: Path, rows: list[dict[str, Any]]) -> Path | None:
    """The run's config with the best measured recommendation, if it beat the baseline."""
    from dtrain.config.schema import dump_config, load_config

    best = next((r for r in rows if r["kind"] == "recommendation" and (r["measured_speedup"] or 0) > 1.0), None)
    if best is None:
        return None
    path = run_dir / "tuned.yaml"
    dump_config(load_config(config, best["sets"]), path)
    low, high = best["speedup_range"]
    predicted = f"{best['predicted_speedup']:.2f}x" if best["predicted_speedup"] else "no prediction"
    note = (f"# dtrain doctor --verify: {best['action']} measured {best['measured_speedup']:.2f}x samples/s "
            f"(median of per-round ratios, range {low:.2f}-{high:.2f}x; predicted {predicted}) over this run's "
            "config;\n"
            f"# {best['spread_verdict']}\n"
            f"# changes: {', '.join(best['sets'])}\n")
    path.write_text(note + path.read_text())
    return path


def render(result: dict[str, Any]) -> str:
    """Predicted vs measured (median of paired ratios, with its range), best measured first."""
    from rich.table import Table

    from dtrain.explain.render import as_text

    base = result["baseline_samples_per_second"]
    rounds = result["rounds"]
    table = Table(title=f"dtrain doctor --verify: {_slots(result)}, {result['steps']} steps x "
                        f"{rounds} round(s); baseline {base:,.0f} samples/s")
    for col in ("action", "kind", "samples/s", "predicted", "measured", "range of per-round ratios"):
        table.add_column(col, justify="left" if col in ("action", "kind", "range of per-round ratios") else "right")
    for r in result["verified"]:
        table.add_row(r["action"], r["kind"], _sps(r["samples_per_second"]),
                      f"{ratio(r['predicted_speedup'])}x" if r["predicted_speedup"] else "-",
                      f"{ratio(r['measured_speedup'])}x" if r["measured_speedup"] else "-",
                      r["spread_verdict"] if rounds > 1 else "-")
    text = as_text(table, width=160)
    text += paired.footer(rounds, "baseline")
    text += (f"tuned config: {result['tuned_config']}\n" if result["tuned_config"]
             else "no recommendation beat the baseline: no tuned.yaml written\n")
    return text


def _sps(value: float | None) -> str:
    return f"{value:,.0f}" if value is not None else "-"


# ------------------------------------------------------------------ --try KEY=VALUE --verify: tried changes
def verify_tries(run_dir: Path, items: list[str], steps: int, repeats: int = 1, debug: bool = False,
                 log: Any = print, max_repeats: int | None = None,
                 target_spread: float = paired.DEFAULT_TARGET_SPREAD, link: str | None = None) -> dict[str, Any]:
    """``--try``'s changes predicted (as ``dtrain doctor --try`` does) and measured, each as a short run with
    that ``--set`` beside the same round's baseline; returns the ``--json`` document. Changes the model cannot
    price are measured all the same; a bad key or value fails before any run."""
    from dtrain.explain.trying import NODES, predict_all

    held: list[str] = []  # the session's own lines wait until every try is accepted: a refusal is one line
    session = open_session(run_dir, steps, repeats, max_repeats, target_spread, held.append)
    predictions = predict_all(run_dir, session.profile, session.predictor, items, link)
    for t in predictions:
        if t.key == NODES:
            raise UserError(f"--try {t.change} --verify: a short run here cannot add hosts; measure it with "
                            "'dtrain run' on the hosts, or drop --verify")
    for line in held:
        log(line)
    experiments = [Experiment("baseline", "baseline", [])]
    experiments += [Experiment(t.change, "try", [f"{t.key}={t.change.partition('=')[2].strip()}"], t.gain)
                    for t in predictions]
    base = experiments[0]
    rounds, folder = measure(session, experiments, repeats, target_spread, debug, log)
    rows = [_tried_row(t, e, base, session.profile, target_spread)
            for t, e in zip(predictions, experiments[1:], strict=True)]
    return {**session_json(session, repeats, rounds, target_spread, base, folder), "tried": rows,
            "tuned_config": None}


def _tried_row(t: TryResult, exp: Experiment, base: Experiment, profile: ProfileRecord,
               target_spread: float) -> dict[str, Any]:
    """One tried change: its prediction with the 80% interval, its paired measurement, the point's error and
    whether the interval held the measured median."""
    figures = measured_figures(exp, base, target_spread)
    measured = figures["measured_speedup"]
    error = held = None
    if t.gain is not None and measured:
        error = (t.gain - measured) / measured
    if measured and t.low is not None and t.high is not None:  # a wide interval without a point is held or not too
        held = t.low <= measured <= t.high
    return {"try": t.change, "key": t.key, "value": t.value, "sets": exp.sets, "predicted_speedup": t.gain,
            "predicted_low": t.low, "predicted_high": t.high, "predicted_samples_per_second": t.samples_per_second,
            "reason": t.reason, "inputs": t.inputs, **figures, "error": error, "interval_held": held,
            "note": _batch_note(t, profile)}


def _batch_note(t: TryResult, profile: ProfileRecord) -> str | None:
    """For a try that changes the global batch: its gain is in samples/s, and the learning rate was left as
    the config had it (throughput does not depend on it; training equivalence does)."""
    from dtrain.explain.advice import batch_change

    if t.key != "hyperparameters.global_batch_size" or not isinstance(t.value, int) \
            or t.value == profile.global_batch_size:
        return None
    change = batch_change(profile, t.value)
    lr = profile.lr_hyperparameter
    kept = (f"the learning rate was left as the config had it (hyperparameters.{lr.name}: {lr.value:g})"
            if lr is not None and lr.name else "the learning rate was left as the trial sets it")
    return (f"gain in samples/s, not steps/s (a step carries {t.value} samples instead of "
            f"{profile.global_batch_size}); {kept}: to train at this batch use the {change.rule} rule "
            f"(learning rate x {change.lr_factor:.3g})")


def render_tries(result: dict[str, Any]) -> str:
    """Each tried change: predicted gain with its 80% interval, measured paired median with its range, the
    point's error and whether the interval held the measurement; reasons and notes below."""
    from rich.table import Table

    from dtrain.explain.render import as_text

    rounds = result["rounds"]
    table = Table(title=f"dtrain doctor --try --verify: {_slots(result)}, {result['steps']} steps x "
                        f"{rounds} round(s); baseline {result['baseline_samples_per_second']:,.0f} samples/s")
    for col in ("try", "samples/s", "predicted (80% interval)", "measured (range over rounds)", "error",
                "interval held"):
        table.add_column(col, justify="left" if col == "try" else "right")
    notes: list[str] = []
    for r in result["tried"]:
        predicted = (f"{ratio(r['predicted_speedup'])}x ({ratio(r['predicted_low'])}-{ratio(r['predicted_high'])})"
                     if r["predicted_speedup"] is not None else
                     f"wide ({ratio(r['predicted_low'])}-{ratio(r['predicted_high'])})"
                     if r["predicted_low"] is not None else "no prediction")
        span = r["speedup_range"]
        measured = ("-" if r["measured_speedup"] is None else f"{ratio(r['measured_speedup'])}x"
                    + (f" ({ratio(span[0])}-{ratio(span[1])})" if span and rounds > 1 else ""))
        error = f"{100 * r['error']:+.0f}%" if r["error"] is not None else "-"
        held = "-" if r["interval_held"] is None else ("yes" if r["interval_held"] else "no")
        table.add_row(r["try"], _sps(r["samples_per_second"]), predicted, measured, error, held)
        notes += [f"{r['try']}: {text}" for text in (r["reason"], r["note"]) if text]
    text = as_text(table, width=160)
    text += "".join(f"  {line}\n" for line in notes)
    text += ("gains are samples/s over the same round's baseline, steady state from each short run's profile; "
             "error = (predicted - measured) / measured\n")
    text += paired.footer(rounds, "baseline")
    return text + "no tuned.yaml written: --try --verify measures the changes given, not the doctor's advice\n"


def _slots(result: dict[str, Any]) -> str:
    return slot_words(result["slots"], bool(result.get("workers_only")))
