#!/usr/bin/env python3
"""How well the cost model predicts held-out configurations, from ONE 1-slot run and from ONE 2-slot run.

Source runs (examples/digits, and the same model 10x larger): 1 slot and 2 slots on this host. From each
alone, the cost model (:mod:`dtrain.explain.costmodel`, as ``dtrain plan`` builds it; a 1-slot source gets
``dtrain plan``'s local link probe) predicts every row:

* 1, 2 and 3 slots on one host; 2 slots with aggregation_frequency 4, fp16, PowerSGD;
* the 10x model on 1 and 2 slots (from its own source runs);
* 2 test hosts x 1 slot (network namespaces, scripts/testhosts.py, one core each): unthrottled veth,
  200 Mbit and 1 Gbit tc tbf links (``--link`` as a user would give it), 200 Mbit with aggregation 4.

Each row is then run and measured, in rounds; within a round every source configuration is measured
again, and a row's measured figure is its *ratio to the same round's run of the source configuration*
(absolute samples/s drift by 10-50% within minutes here; ratios to a run just before do not). The
prediction is compared the same way: predicted row / predicted source configuration. The interval holds
when the measured ratio lies inside the predicted 80% interval over the predicted source figure.

    sudo .venv/bin/python bench/plan_accuracy.py [--steps 400] [--repeats 3] [--json out.json] [--out DIR]

Root is needed for the test hosts (without it their rows are skipped and said so). With ``--out DIR`` runs
are kept, and a run whose profile.json is there is not run again (an interrupted session continues).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.explain.costmodel import CostModel, Target
from dtrain.explain.plan import build_model, parse_link
from dtrain.profiling.record import load_profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
CONFIG = ROOT / "examples" / "digits" / "experiment.yaml"
PORT = 29530
# hidden 480 instead of 128: 10.2x the parameters (266k).
BIG = ["hyperparameters.hidden=480"]


@dataclass
class Row:
    label: str
    slots: int
    nodes: int = 1
    sets: list[str] = field(default_factory=list)
    rate: str | None = None  # tbf rate between test hosts (None: unthrottled)
    target: dict = field(default_factory=dict)
    model: str = "small"
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
        Row("2 hosts x 1 slot, unthrottled veth", 2, 2, target={"cores": 1}),
        Row("2 hosts x 1 slot, 1 Gbit", 2, 2, rate="1gbit", target={"cores": 1}),
        Row("2 hosts x 1 slot, 200 Mbit", 2, 2, rate="200mbit", target={"cores": 1}),
        Row("2 hosts x 1 slot, 200 Mbit, aggregation_frequency 4", 2, 2,
            sets=["optimizations.aggregation_frequency=4"], rate="200mbit", target={"cores": 1, "aggregation": 4}),
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


def run_local(slots: int, sets: list[str], steps: int, run_dir: Path) -> float:
    if (done_before := _done(run_dir)) is not None:
        return done_before
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted attempt
    argv = [sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--slots", str(slots), "--run-dir",
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


def predict(model: CostModel, row: Row) -> tuple[float, float, float]:
    """(predicted, low, high) samples/s of ``row`` over the model's prediction of its own run."""
    mine = model.predict(model.measured_target())
    pred = model.predict(Target(row.slots, row.nodes, **row.target))
    base = mine.samples_per_second
    return pred.samples_per_second / base, pred.samples_per_second_low / base, pred.samples_per_second_high / base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--out", type=Path, help="keep the runs here (and continue an interrupted session)")
    args = parser.parse_args(argv)
    from testhosts import unavailable_reason

    no_hosts = unavailable_reason()
    table = rows()
    sources = {(m, n): [*(BIG if m == "big" else [])] for m in ("small", "big") for n in (1, 2)}
    loads = [os.getloadavg()[0]]
    with contextlib.ExitStack() as stack:
        tmp = Path(args.out or stack.enter_context(tempfile.TemporaryDirectory(prefix="dtrain-plan-accuracy-")))
        models: dict[tuple[str, int, str | None], CostModel] = {}
        for (m, n), sets in sources.items():
            run_local(n, sets, args.steps, tmp / f"source-{m}-{n}")
        predicted: dict[tuple[str, int], tuple[float, float, float]] = {}
        for row in table:
            for n in (1, 2):
                key = (row.model, n, row.rate)
                if key not in models:
                    link = parse_link(row.rate) if row.rate else None
                    _, models[key] = build_model(tmp / f"source-{row.model}-{n}", link,
                                              log=lambda line: print(line, file=sys.stderr))
                predicted[(row.label, n)] = predict(models[key], row)
        ratios: dict[tuple[str, int], list[float]] = {(row.label, n): [] for row in table for n in (1, 2)}
        for r in range(args.repeats):
            reference = {key: run_local(key[1], sets, args.steps, tmp / f"r{r}-ref-{key[0]}-{key[1]}")
                         for key, sets in sources.items()}
            order = table if r % 2 == 0 else list(reversed(table))
            for row in order:
                if row.nodes > 1 and no_hosts:
                    continue
                print(f"plan_accuracy: [{r + 1}/{args.repeats}] {row.label} ...", file=sys.stderr, flush=True)
                folder = tmp / f"r{r}-{table.index(row):02d}"
                sps = run_hosts(row, args.steps, folder) if row.nodes > 1 else run_local(row.slots, row.sets,
                                                                                         args.steps, folder)
                for n in (1, 2):
                    ratios[(row.label, n)].append(sps / reference[(row.model, n)])
            loads.append(os.getloadavg()[0])
    report(table, predicted, ratios, args, loads, no_hosts)
    return 0


def report(table: list[Row], predicted: dict, ratios: dict, args: argparse.Namespace, loads: list[float],
           no_hosts: str | None) -> None:
    print(f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.steps} steps per run, "
          f"{args.repeats} round(s), medians of per-round ratios; load average (1 min) "
          f"{', '.join(f'{x:.1f}' for x in loads)} (start, after each round).\n")
    print("| configuration | from | predicted ratio (80% interval) | measured ratio (rounds) | error | in interval |")
    print("|---|---|---|---|---|---|")
    out, errors, inside = [], [], []
    for row in table:
        for n in (1, 2):
            if row.slots == n and row.nodes == 1 and row.model in ("small", "big") and not row.target:
                continue  # the source itself
            value, low, high = predicted[(row.label, n)]
            rounds = ratios[(row.label, n)]
            name = f"{'10x ' if row.model == 'big' else ''}{n}-slot run"
            if not rounds:
                print(f"| {row.label} | {name} | {value:.2f} ({low:.2f}-{high:.2f}) | skipped: {no_hosts} | - | - |")
                continue
            measured = statistics.median(rounds)
            error = value / measured - 1
            hit = low <= measured <= high
            errors.append(abs(error))
            inside.append(hit)
            print(f"| {row.label} | {name} | {value:.2f} ({low:.2f}-{high:.2f}) | {measured:.2f} "
                  f"({', '.join(f'{x:.2f}' for x in rounds)}) | {100 * error:+.0f}% | {'yes' if hit else 'no'} |")
            out.append({"label": row.label, "source_slots": n, "model": row.model, "predicted": value, "low": low,
                        "high": high, "measured": measured, "rounds": rounds, "error": error, "inside": hit})
    if errors:
        print(f"\nmean absolute error {100 * statistics.mean(errors):.1f}%, worst {100 * max(errors):.0f}%, "
              f"interval holds in {sum(inside)}/{len(inside)} rows ({100 * sum(inside) / len(inside):.0f}%)")
    if args.json:
        args.json.write_text(json.dumps({"rows": out, "loads": loads}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
