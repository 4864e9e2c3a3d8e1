#!/usr/bin/env python3
"""How well the cost model predicts held-out configurations: stored rows evaluated, re-fitted, or re-measured.

Without options it trains nothing: it predicts every stored row of ``bench/data/plan_rows.json`` (published
large-scale results from their ``--what-if`` inputs; rows measured on this host from the inputs their model
had) with the constants in ``src/dtrain/explain/fitted_intervals.json``, and again with constants fitted
without each row's configuration (leave-one-configuration-out), and prints the accuracy tables::

    .venv/bin/python bench/plan_accuracy.py [--json out.json]        # evaluate the stored rows
    .venv/bin/python bench/plan_accuracy.py --refit                  # fit the constants again, write them
    sudo .venv/bin/python bench/plan_accuracy.py --measure [--append] [--steps 1500] [--repeats 3] [--out DIR]

``--measure`` runs the held-out configurations on this host and stores them as rows (replacing the stored
measured rows): source runs (examples/digits, and the same model 10x larger) with 1 and 2 slots (as long as
the rows' runs, or ``--source-factor`` times); from each alone, the cost model (as ``dtrain plan`` builds it; a
1-slot source gets ``dtrain plan``'s local link probe) predicts every row:

* 1, 2 and 3 slots on one host; 2 slots with aggregation_frequency 4, fp16, PowerSGD;
* the 10x model on 1 and 2 slots (from its own source runs);
* compute changes, predicted from the source run's own timed model steps (``model_steps``) as ``dtrain doctor
  --try`` predicts them: bf16-mixed on 1 and 2 slots, for the 10x model and for bench/models.py's mlp-1m
  (1.06M parameters, one slot: on a CPU with AMX its bf16 steps are faster, digits' slower), twice the
  global batch for each model;
* 2 test hosts x 1 slot (network namespaces, scripts/testhosts.py, one core each): unthrottled veth,
  200 Mbit and 1 Gbit tc tbf links (``--link`` as a user would give it, with tbf's bucket), 200 Mbit with
  aggregation 4.

Each row is then run and measured, in rounds; every source configuration is measured again at the start
and at the end of each round (one round's end is the next one's start), and a row's measured figure is its
*ratio to the geometric mean of that round's two runs of the source configuration* (absolute samples/s drift
by 10-50% within minutes on a shared host; a ratio to runs just before and after cancels a drift that is
steady over the round), the median over the rounds. ``--append`` keeps the rows of earlier sessions and adds
this one's (each session is one repeat of the bench; the accuracy goals hold in each). The prediction is
compared the same way: predicted row / predicted source configuration. Root is needed for
the test hosts (without it their rows are skipped and said so). With ``--out DIR`` runs are kept, and a run
whose profile.json is there is not run again (an interrupted session continues). Measure on a quiet host:
other processes on the cores move the ratios by more than the model's error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from dtrain.explain import fitted
from dtrain.explain.calibration import (
    Outcome,
    Summary,
    evaluate,
    fit,
    held_out,
    model_to_json,
    other_host,
    rows_from_json,
    with_values,
)
from dtrain.explain.costmodel import CostModel, Link, Target
from dtrain.explain.plan import build_model, parse_link
from dtrain.explain.precision import estimate
from dtrain.explain.predictor import target_at
from dtrain.profiling.record import load_profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
CONFIG = ROOT / "examples" / "digits" / "experiment.yaml"
PORT = 29530
# hidden 480 instead of 128: 10.2x the parameters (266k).
BIG = ["hyperparameters.hidden=480"]
# bench/models.py's mlp-1m: matmuls large enough that bf16 autocast beats float32 on a CPU with AMX.
MLP1M = ROOT / "bench" / "trials" / "mlp1m.yaml"
ROWS = ROOT / "bench" / "data" / "plan_rows.json"
FITTED = ROOT / "src" / "dtrain" / "explain" / "fitted_intervals.json"
# scripts/testhosts.py shapes each test host's link with tc tbf "burst 32kbit": 4,000 bytes.
TBF_BURST_BYTES = 4000.0
# Each test host is one pinned core of this machine, a network namespace: the two hosts' slots share its caches
# and memory bandwidth, as two local slots do (real hosts would not).
TEST_HOSTS = {"cores": 1, "machine_slots": 2}


@dataclass(frozen=True)
class Source:
    """A source model: its config and sets, the slot counts of its source runs, its share of ``--steps``
    (mlp-1m's step is ten times digits'), and its name in row labels."""

    config: Path
    sets: tuple[str, ...]
    slots: tuple[int, ...]
    steps_share: float
    name: str


SOURCES = {"small": Source(CONFIG, (), (1, 2), 1.0, ""), "big": Source(CONFIG, tuple(BIG), (1, 2), 1.0, "10x "),
           "mlp-1m": Source(MLP1M, (), (1,), 0.25, "mlp-1m ")}


@dataclass
class Row:
    label: str
    slots: int
    nodes: int = 1
    sets: list[str] = field(default_factory=list)
    rate: str | None = None  # tbf rate between test hosts (None: unthrottled)
    target: dict = field(default_factory=dict)
    model: str = "small"
    precision: str | None = None  # a compute change priced from the source run's timed model steps
    measured: list[float] = field(default_factory=list)  # per round: ratio to each source's run, by source


def rows() -> list[Row]:
    return [
        Row("1 slot", 1),
        Row("2 slots", 2),
        Row("3 slots", 3),
        Row("2 slots, aggregation_frequency 4", 2, sets=["optimizations.aggregation_frequency=4"],
            target={"aggregation": 4}),
        Row("2 slots, fp16 compression", 2, sets=["optimizations.gradient_compression=fp16"],
            target={"compression": "fp16"}),
        Row("2 slots, PowerSGD", 2, sets=["optimizations.gradient_compression=powersgd"],
            target={"compression": "powersgd"}),
        Row("10x model, 1 slot", 1, sets=BIG, model="big"),
        Row("10x model, 2 slots", 2, sets=BIG, model="big"),
        Row("1 slot, bf16-mixed", 1, sets=["precision=bf16-mixed"], precision="bf16-mixed"),
        Row("2 slots, bf16-mixed", 2, sets=["precision=bf16-mixed"], precision="bf16-mixed"),
        Row("10x model, 1 slot, bf16-mixed", 1, sets=[*BIG, "precision=bf16-mixed"], model="big",
            precision="bf16-mixed"),
        Row("1 slot, global batch 128", 1, sets=["hyperparameters.global_batch_size=128"],
            target={"global_batch": 128}),
        Row("10x model, 2 slots, global batch 128", 2, sets=[*BIG, "hyperparameters.global_batch_size=128"],
            model="big", target={"global_batch": 128}),
        Row("mlp-1m, 1 slot, bf16-mixed", 1, sets=["precision=bf16-mixed"], model="mlp-1m", precision="bf16-mixed"),
        Row("mlp-1m, 1 slot, global batch 512", 1, sets=["hyperparameters.global_batch_size=512"], model="mlp-1m",
            target={"global_batch": 512}),
        Row("2 hosts x 1 slot, unthrottled veth", 2, 2, target=TEST_HOSTS),
        Row("2 hosts x 1 slot, 1 Gbit", 2, 2, rate="1gbit", target=TEST_HOSTS),
        Row("2 hosts x 1 slot, 200 Mbit", 2, 2, rate="200mbit", target=TEST_HOSTS),
        Row("2 hosts x 1 slot, 200 Mbit, aggregation_frequency 4", 2, 2,
            sets=["optimizations.aggregation_frequency=4"], rate="200mbit", target={**TEST_HOSTS, "aggregation": 4}),
    ]


def _short(steps: int) -> list[str]:
    sets = [f"max_length={{batches: {steps}}}", "min_validation_period=null", "min_checkpoint_period=null",
            f"scheduling_unit={steps}", "profiling.enabled=true"]
    return [arg for s in sets for arg in ("--set", s)]


def _sets(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def _done(run_dir: Path) -> float | None:
    path = run_dir / "profile.json"
    return load_profile(path).samples_per_second if path.is_file() else None


def run_local(slots: int, sets: list[str], steps: int, run_dir: Path, config: Path = CONFIG) -> float:
    if (done_before := _done(run_dir)) is not None:
        return done_before
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted attempt
    argv = [sys.executable, "-m", "dtrain.cli", "run", str(config), "--slots", str(slots), "--run-dir",
            str(run_dir), "--quiet", *_short(steps), *_sets(sets)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed:\n{done.stderr[-3000:]}")
    return load_profile(run_dir / "profile.json").samples_per_second


def run_hosts(row: Row, steps: int, run_dir: Path) -> float:
    from link import _run_pair
    from testhosts import TestHosts

    if (done_before := _done(run_dir)) is not None:
        return done_before
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with TestHosts(2, rate=row.rate, pin_cpus=True) as hosts:
        def argv(i: int) -> list[str]:
            return [sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--slots", "2", "--nnodes", "2",
                    "--node-rank", str(i), "--master", f"{hosts.hostname(0)}:{PORT}", "--run-dir", str(run_dir),
                    "--quiet", *_short(steps), *_sets(row.sets)]

        _run_pair(hosts, argv, env, timeout=900)
    return load_profile(run_dir / "profile.json").samples_per_second


def source_link(rate: str | None) -> Link | None:
    """The link between test hosts as a user gives it (``--link RATE``), with tbf's bucket (testhosts.py)."""
    return replace(parse_link(rate), burst_bytes=TBF_BURST_BYTES) if rate else None


def _target(row: Row, source_dir: Path, built: CostModel) -> Target | None:
    """The row's target as ``dtrain doctor --try`` builds it from the source run's model (at the run's own
    slot and node count its threads stay as measured, elsewhere they follow the launcher's rule); a precision
    from the run's timed model steps (None: the source did not time that precision)."""
    changes = dict(row.target)
    if row.precision is not None:
        found = estimate(load_profile(source_dir / "profile.json"), row.precision)
        if found.gain is None:
            print(f"plan_accuracy: {row.label} skipped: {found.source}", file=sys.stderr)
            return None
        changes.update(found.changes())
    return target_at(built, row.slots, row.nodes, **changes)


def _threads(run_dir: Path) -> int:
    """Torch threads per slot a run got (the launcher gives fewer where it finds cores busy)."""
    path = run_dir / "profile.json"
    return load_profile(path).threads_per_slot if path.is_file() else 0


def _steps(model: str, steps: int) -> int:
    return max(100, round(steps * SOURCES[model].steps_share))


def _run(model: str, slots: int, sets: list[str], steps: int, run_dir: Path) -> float:
    return run_local(slots, sets, _steps(model, steps), run_dir, SOURCES[model].config)


def _references(steps: int, folder: Path) -> dict[tuple[str, int], float]:
    return {(m, n): _run(m, n, list(src.sets), steps, folder / f"ref-{m}-{n}")
            for m, src in SOURCES.items() for n in src.slots}


def measure(args: argparse.Namespace) -> list[dict]:
    """Run the source configurations and every row in rounds; the rows with their models' inputs."""
    from testhosts import unavailable_reason

    no_hosts = unavailable_reason()
    if no_hosts:
        print(f"plan_accuracy: the 2-host rows are skipped: {no_hosts}", file=sys.stderr)
    table = rows()
    stored = []
    with contextlib.ExitStack() as stack:
        tmp = Path(args.out or stack.enter_context(tempfile.TemporaryDirectory(prefix="dtrain-plan-accuracy-")))
        models: dict[tuple[str, int, str | None], CostModel] = {}
        for m, src in SOURCES.items():
            for n in src.slots:
                _run(m, n, list(src.sets), args.source_factor * args.steps, tmp / f"source-{m}-{n}")
        for row in table:
            for n in SOURCES[row.model].slots:
                key = (row.model, n, row.rate)
                if key not in models:
                    _, built = build_model(tmp / f"source-{row.model}-{n}", None,
                                           log=lambda line: print(line, file=sys.stderr))
                    models[key] = replace(built, between_hosts=source_link(row.rate))
        ratios: dict[tuple[str, int], list[float]] = {(row.label, n): [] for row in table
                                                      for n in SOURCES[row.model].slots}
        threads: dict[str, set[int]] = {}
        after = _references(args.steps, tmp / "r0-before")
        for r in range(args.repeats):
            runs: dict[str, float] = {}
            before = after  # one round's closing references open the next
            for row in table if r % 2 == 0 else list(reversed(table)):
                if row.nodes > 1 and no_hosts:
                    continue
                print(f"plan_accuracy: [{r + 1}/{args.repeats}] {row.label} ...", file=sys.stderr, flush=True)
                folder = tmp / f"r{r}-{table.index(row):02d}"
                runs[row.label] = (run_hosts(row, args.steps, folder) if row.nodes > 1
                                   else _run(row.model, row.slots, row.sets, args.steps, folder))
                threads.setdefault(row.label, set()).add(_threads(folder))
            after = _references(args.steps, tmp / f"r{r}-after")
            for row in table:
                for n in SOURCES[row.model].slots:
                    if row.label in runs:
                        reference = math.sqrt(before[(row.model, n)] * after[(row.model, n)])
                        ratios[(row.label, n)].append(runs[row.label] / reference)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for row in table:
        for n in SOURCES[row.model].slots:
            itself = row.slots == n and row.nodes == 1 and not row.target and row.precision is None
            if itself or not ratios[(row.label, n)]:
                continue  # the source itself, or skipped
            source_dir = tmp / f"source-{row.model}-{n}"
            built = models[(row.model, n, row.rate)]
            target = _target(row, source_dir, built)
            if target is None:
                continue
            ran, assumed = threads[row.label], built.local_threads(target)[1]
            if ran != {assumed}:  # the launcher found busy cores: the model priced other threads than ran
                print(f"plan_accuracy: warning: {row.label} ran with {sorted(ran)} thread(s) per slot; the model "
                      f"priced {assumed}", file=sys.stderr)
            source = f"{SOURCES[row.model].name}{n}-slot run"
            stored.append({"config": row.label, "label": f"{row.label} (from the {source}), repeat {args.session}",
                           "rounds": ratios[(row.label, n)], "measured_at": when,
                           "steps": args.steps, "repeat": args.session, "source": model_to_json(built, target)})
    return stored


def _table(title: str, outcomes: list[Outcome]) -> str:
    lines = [f"\n{title}\n", "| row | predicted (80% interval) | measured | error | covered |", "|---|---|---|---|---|"]
    for o in outcomes:
        digits = ",.0f" if o.predicted >= 100 else ".3f"
        lines.append(f"| {o.row.label} | {o.predicted:{digits}} ({o.low:{digits}}-{o.high:{digits}}) | "
                     f"{o.row.measured:{digits}} | {100 * o.error:+.1f}% | {'yes' if o.inside else 'no'} |")
    s = Summary.of(outcomes)
    if s.rows:
        lines.append(f"\n{s.rows} rows: mean absolute error {100 * s.mean_error:.1f}%, "
                     f"worst {100 * s.worst_error:.1f}%, covered {100 * s.covered:.0f}%, "
                     f"widest interval +/-{100 * s.widest_half_width:.0f}%")
    return "\n".join(lines)


def _legacy(document: dict) -> str:
    lines = ["\nLegacy rows (model and measurements of their session; inputs not kept, not re-predictable)\n",
             "| row | predicted (80% interval) | measured (median of rounds) | error | covered |",
             "|---|---|---|---|---|"]
    errors, covered = [], []
    for r in document["legacy"]:
        measured = statistics.median(r["rounds"])
        errors.append(abs(r["predicted"] / measured - 1))
        covered.append(r["low"] <= measured <= r["high"])
        lines.append(f"| {r['label']} | {r['predicted']:.2f} ({r['low']:.2f}-{r['high']:.2f}) | {measured:.2f} | "
                     f"{100 * (r['predicted'] / measured - 1):+.0f}% | {'yes' if covered[-1] else 'no'} |")
    if errors:
        lines.append(f"\n{len(errors)} rows: mean absolute error {100 * statistics.mean(errors):.1f}%, worst "
                     f"{100 * max(errors):.0f}%, covered {100 * sum(covered) / len(covered):.0f}%")
    return "\n".join(lines)


def _repeats(outcomes: list[Outcome]) -> str:
    """The summary of each repeat's measured rows (the goals hold in each)."""
    lines = []
    for repeat in sorted({o.row.repeat for o in outcomes if o.row.repeat}):
        s = Summary.of([o for o in outcomes if o.row.repeat == repeat])
        lines.append(f"repeat {repeat}: {s.rows} measured rows held out: mean absolute error "
                     f"{100 * s.mean_error:.1f}%, worst {100 * s.worst_error:.1f}%, covered {100 * s.covered:.0f}%, "
                     f"widest interval +/-{100 * s.widest_half_width:.0f}%")
    return "\n".join(["", *lines]) if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refit", action="store_true", help="fit the constants to the stored rows and write them")
    parser.add_argument("--measure", action="store_true", help="run the held-out configurations and store them")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    # Longer sources average this machine's drift, but a run's late steps differ from a short run's (the 10x
    # model's optimizer phase was slower over 6,000 steps than over 1,500): the rows' runs are the truth.
    parser.add_argument("--source-factor", type=int, default=1,
                        help="--measure: source runs this many times --steps (the 2026-11-27 rows: 4)")
    parser.add_argument("--rows", type=Path, default=ROWS, help="the stored rows (default: bench/data/plan_rows.json)")
    parser.add_argument("--fitted", type=Path, default=FITTED, help="the constants' file --refit writes")
    parser.add_argument("--json", type=Path, help="write the evaluation here")
    parser.add_argument("--append", action="store_true",
                        help="--measure: keep the measured rows of earlier sessions (one repeat each) and add these")
    parser.add_argument("--no-fit", action="store_true",
                        help="--measure: store the rows and stop (a later --refit fits and evaluates them)")
    parser.add_argument("--out", type=Path, help="--measure: keep the runs here (and continue an interrupted session)")
    args = parser.parse_args(argv)
    document = json.loads(args.rows.read_text())
    if args.measure:
        kept = document["measured"] if args.append else []
        args.session = 1 + len({r.get("repeat", 0) for r in kept})
        document["measured"] = kept + measure(args)
        args.rows.write_text(json.dumps(document, indent=1) + "\n")
        if args.no_fit:
            return 0
    stored = rows_from_json(document)
    start = fitted.load()
    out = held_out(stored, start)
    if args.refit or args.measure:
        values, names = fit(stored, start)
        held = Summary.of(out)
        written = with_values(json.loads(args.fitted.read_text()), values, names)
        written["fit"] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": held.rows,
                          "held_out_mean_error": round(held.mean_error, 4),
                          "held_out_worst_error": round(held.worst_error, 4),
                          "held_out_covered": round(held.covered, 4)}
        args.fitted.write_text(json.dumps(written, indent=1) + "\n")
        print(f"plan_accuracy: fitted {', '.join(names)}; written to {args.fitted}", file=sys.stderr)
        start = values
    with fitted.trying(start):
        current = evaluate(stored)
    print(_table("With the stored constants (in-sample)", current))
    print(_table("Held out (constants fitted without the row's configuration)", out))
    print(_repeats(out))
    elsewhere = other_host(document, start)
    if elsewhere:
        print(_table("Another host (its rows kept out of the fit: constants fitted on the rows above only)", elsewhere))
        print(_repeats(elsewhere).replace("held out", "on the other host"))
    print(_legacy(document))
    if args.json:
        args.json.write_text(json.dumps({"held_out": [_as_dict(o) for o in out],
                                         "in_sample": [_as_dict(o) for o in current],
                                         "other_host": [_as_dict(o) for o in elsewhere]}, indent=1))
    return 0


def _as_dict(o: Outcome) -> dict:
    return {"label": o.row.label, "predicted": o.predicted, "low": o.low, "high": o.high, "measured": o.row.measured,
            "error": o.error, "inside": o.inside, "widest": o.widest}


if __name__ == "__main__":
    sys.exit(main())
