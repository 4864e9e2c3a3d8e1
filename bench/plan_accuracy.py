#!/usr/bin/env python3
"""How well ``dtrain plan`` predicts: one measured run, predictions for 9 configurations, each measured.

The measured run: examples/digits on 2 slots of one host. From it alone (plus the link's nominal rate
for the throttled rows), ``dtrain.explain.plan`` predicts samples/s for:

* 1, 2 and 3 slots on one host; 2 slots with ``aggregation_frequency: 4``; 2 slots with fp16 compression;
* 2 test hosts x 1 slot (network namespaces, scripts/testhosts.py, each pinned to its own core):
  unthrottled veth, and a 200 Mbit tc tbf link with aggregation 1 and 4 and with fp16 compression.

Each configuration is then run and measured (steady-state samples/s from its profile.json), in rounds:
each round measures the 2-slot configuration again first, and every other configuration is compared as a
*ratio to that round's 2-slot run*, predicted vs measured. On a machine shared with other jobs the same
configuration's samples/s drifts by 2-3x within minutes (measured here), so absolute figures from one run
cannot be checked against runs minutes later; ratios to a run measured just before can. With
``--repeats R`` the median ratio over rounds counts. Root is needed for the test hosts (without it the
host rows are skipped and said so).

    sudo .venv/bin/python bench/plan_accuracy.py [--steps 500] [--repeats 2] [--rate 200mbit] [--json out.json]
                                                 [--out DIR]

With ``--out DIR`` the runs are kept there, and a run whose ``profile.json`` is already there is not run
again: an interrupted session continues where it stopped.

Prints a Markdown table: configuration, predicted, measured, error.
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

from dtrain.profiling.record import load_profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
CONFIG = ROOT / "examples" / "digits" / "experiment.yaml"
PORT = 29530


@dataclass
class Row:
    label: str
    slots: int
    nodes: int
    sets: list[str]
    rate: str | None = None  # tbf rate between hosts (None: unthrottled)
    option: str = "base"
    predicted: float | None = None
    measured: list[float] = field(default_factory=list)


def rows(rate: str) -> list[Row]:
    return [
        Row("1 slot, 1 host", 1, 1, []),
        Row("2 slots, 1 host (the measured configuration)", 2, 1, []),
        Row("3 slots, 1 host", 3, 1, []),
        Row("2 slots, 1 host, aggregation_frequency 4", 2, 1, ["optimizations.aggregation_frequency=4"],
            option="aggregation"),
        Row("2 slots, 1 host, fp16 compression", 2, 1, ["optimizations.gradient_compression=fp16"],
            option="compression"),
        Row("2 hosts x 1 slot, unthrottled veth", 2, 2, []),
        Row(f"2 hosts x 1 slot, {rate}", 2, 2, [], rate=rate),
        Row(f"2 hosts x 1 slot, {rate}, aggregation_frequency 4", 2, 2, ["optimizations.aggregation_frequency=4"],
            rate=rate, option="aggregation"),
        Row(f"2 hosts x 1 slot, {rate}, fp16 compression", 2, 2, ["optimizations.gradient_compression=fp16"],
            rate=rate, option="compression"),
    ]


def _short(steps: int) -> list[str]:
    sets = [f"max_length={{batches: {steps}}}", "min_validation_period=null", "min_checkpoint_period=null",
            f"scheduling_unit={steps}", "profiling.enabled=true"]
    return [arg for s in sets for arg in ("--set", s)]


def _done(run_dir: Path) -> float | None:
    path = run_dir / "profile.json"
    return load_profile(path).samples_per_second if path.is_file() else None


def run_local(row: Row, steps: int, run_dir: Path) -> float:
    if (done_before := _done(run_dir)) is not None:
        return done_before
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted attempt
    argv = [sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--slots", str(row.slots), "--run-dir",
            str(run_dir), "--quiet", *_short(steps), *[a for s in row.sets for a in ("--set", s)]]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{row.label} failed:\n{done.stderr[-3000:]}")
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
                    "--quiet", *_short(steps), *[a for s in row.sets for a in ("--set", s)]]

        _run_pair(hosts, argv, env, timeout=900)
    return load_profile(run_dir / "profile.json").samples_per_second


def predict(base: Path, row: Row) -> float:
    from dtrain.explain.plan import Case, Measured, parse_link, predict_step

    m = Measured.from_run(base)
    link = parse_link(row.rate) if row.rate else parse_link("measured")
    case = Case(row.slots, row.nodes, row.option, aggregation=4 if row.option == "aggregation" else 1,
                compression="fp16" if row.option == "compression" else "none")
    return m.global_batch / predict_step(m, case, link)["step"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--out", type=Path, help="keep the runs here (and continue an interrupted session)")
    args = parser.parse_args(argv)
    from testhosts import unavailable_reason

    no_hosts = unavailable_reason()
    table = rows(args.rate)
    base_row = table[1]
    loads = [os.getloadavg()[0]]
    with contextlib.ExitStack() as stack:
        tmp = args.out or stack.enter_context(tempfile.TemporaryDirectory(prefix="dtrain-plan-accuracy-"))
        base = Path(tmp) / "base"
        base_sps = run_local(base_row, args.steps, base)
        for row in table:
            row.predicted = predict(base, row)
        ratios: dict[str, list[float]] = {row.label: [] for row in table}
        for r in range(args.repeats):
            reference = run_local(base_row, args.steps, Path(tmp) / f"r{r}-reference")
            others = [row for row in table if row is not base_row]
            for i, row in enumerate(others if r % 2 == 0 else list(reversed(others))):
                if row.nodes > 1 and no_hosts:
                    continue
                print(f"plan_accuracy: [{r + 1}/{args.repeats}] {row.label} ...", file=sys.stderr, flush=True)
                run = run_hosts if row.nodes > 1 else run_local
                row.measured.append(run(row, args.steps, Path(tmp) / f"r{r}-{i}"))
                ratios[row.label].append(row.measured[-1] / reference)
            base_row.measured.append(reference)
            loads.append(os.getloadavg()[0])
    print(f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.steps} steps per run, "
          f"{args.repeats} round(s), medians; load average (1 min) {', '.join(f'{x:.1f}' for x in loads)} "
          f"(start, after each round). The measured configuration: {base_sps:,.0f} samples/s in the run the "
          f"predictions come from, {', '.join(f'{x:,.0f}' for x in base_row.measured)} in the rounds.\n")
    print("| configuration | predicted samples/s | predicted ratio to 2 slots | measured ratio (rounds) | error |")
    print("|---|---|---|---|---|")
    out = []
    for row in table:
        predicted_ratio = row.predicted / base_row.predicted
        if row is base_row:
            print(f"| {row.label} | {row.predicted:,.0f} | 1 | 1 | - |")
            continue
        if not ratios[row.label]:
            print(f"| {row.label} | {row.predicted:,.0f} | {predicted_ratio:.2f} | skipped: {no_hosts} | - |")
            continue
        measured = statistics.median(ratios[row.label])
        error = predicted_ratio / measured - 1
        rounds = ", ".join(f"{x:.2f}" for x in ratios[row.label])
        print(f"| {row.label} | {row.predicted:,.0f} | {predicted_ratio:.2f} | {measured:.2f} ({rounds}) | "
              f"{100 * error:+.0f}% |")
        out.append({"label": row.label, "predicted": row.predicted, "predicted_ratio": predicted_ratio,
                    "measured": row.measured, "measured_ratios": ratios[row.label], "error": error})
    if args.json:
        args.json.write_text(json.dumps({"rows": out, "loads": loads, "base_samples_per_second": base_sps,
                                         "reference_runs": base_row.measured}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
