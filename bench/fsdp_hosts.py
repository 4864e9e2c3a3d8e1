#!/usr/bin/env python3
"""FSDP across test hosts against the doctor's prediction from a one-host FSDP run.

The cost model prices another host count of an FSDP run by holding the run's collectives as measured and
scaling them by the ring through the slower link (:mod:`dtrain.explain.costmodel`). This checks that scale
where it matters most, between hosts: 2 test hosts x 1 slot (network namespaces, scripts/testhosts.py, one
core each, tc tbf at each rate) against the same model's 2-slot FSDP run on this host::

    .venv/bin/python bench/fsdp_hosts.py [--rates 1gbit,200mbit] [--rounds 3] [--steps 300] [--hidden 128]

Root is needed (network namespaces). Each round runs the source, then each rate across the hosts, then the
source again; a rate's ratio is its samples/s over the geometric mean of the source runs just before and
after it (a host's speed drifts by more than the model's error within minutes), the median over rounds. The
prediction is the doctor's ``--try nodes=2 --link RATE`` (with tbf's bucket, as bench/plan_accuracy.py gives
it) from the first source run's profile.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from plan_accuracy import run_hosts, run_local, source_link  # noqa: E402

from dtrain.explain.costmodel import CostModel  # noqa: E402
from dtrain.explain.predictor import target_at  # noqa: E402
from dtrain.profiling.record import load_profile  # noqa: E402


def predicted(source: Path, rate: str) -> tuple[float, float, float]:
    """The doctor's gain (and 80% interval) of 2 hosts x 1 slot at ``rate`` over the 2-slot source run."""
    model = CostModel.from_profile(load_profile(source / "profile.json"), between_hosts=source_link(rate))
    base = model.predict(model.measured_target(), interval=False).samples_per_second
    found = model.predict(target_at(model, 2, 2))
    return (found.samples_per_second / base, found.samples_per_second_low / base,
            found.samples_per_second_high / base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1gbit,200mbit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    sets = ["sync.strategy=fsdp", f"hyperparameters.hidden={args.hidden}"]
    rates = args.rates.split(",")
    ratios: dict[str, list[float]] = {rate: [] for rate in rates}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sources = [run_local(2, sets, args.steps, folder / "source-0")]
        for r in range(args.rounds):
            for i, rate in enumerate(rates):
                row = SimpleNamespace(rate=rate, sets=sets)
                hosts = run_hosts(row, args.steps, folder / f"hosts-{rate}-{r}")  # type: ignore[arg-type]
                sources.append(run_local(2, sets, args.steps, folder / f"source-{r}-{i}"))
                ratios[rate].append(hosts / math.sqrt(sources[-2] * sources[-1]))
                print(f"round {r + 1}: {rate}: {ratios[rate][-1]:.3f}", file=sys.stderr, flush=True)
        print(f"FSDP, digits (hidden {args.hidden}), 2 test hosts x 1 slot over the 2-slot run on one host, "
              f"{args.rounds} rounds, {args.steps} steps each\n")
        print("| link | predicted (80%) | measured (median; rounds) | error | held |\n|---|---|---|---|---|")
        for rate in rates:
            point, low, high = predicted(folder / "source-0", rate)
            measured = statistics.median(ratios[rate])
            rounds = ", ".join(f"{x:.3f}" for x in ratios[rate])
            print(f"| {rate} | {point:.3f} ({low:.3f}-{high:.3f}) | {measured:.3f} ({rounds}) | "
                  f"{100 * (point / measured - 1):+.0f}% | {'yes' if low <= measured <= high else 'no'} |")


if __name__ == "__main__":
    main()
