#!/usr/bin/env python3
"""A precision at another per-slot batch and thread count than the source run's: predicted and measured.

A change of slots changes each slot's batch and threads, and a precision's gain moves with both (on a CPU
without bf16 units, bf16-mixed's step grows with the batch and gains little from threads). The model-step
probe times every precision at the batch and twice it, on the run's threads and the solo probe's others, and
the cost model prices a precision at a target's shape from those (:class:`dtrain.explain.precision.GainCurve`).
This runs digits' MLP (hidden 480, as bench/plan_accuracy.py's 10x model) on 1 and 2 slots in float32 (the
sources, profiled, 4x the steps), then in rounds: the float32 references, bf16-mixed on 1 and 2 slots, the
references again::

    .venv/bin/python bench/precision_shape.py [--rounds 3] [--steps 1500] [--hidden 480] [--out DIR]

Each bf16-mixed run's ratio to a source is its samples/s over the geometric mean of that source's references
just before and after it, the median over the rounds. Each is predicted from each source's profile as
``dtrain plan`` prices its precision row: with the curve, and with the gain at the source's own shape carried
unchanged (what dtrain did before 2026-11-28).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from plan_accuracy import run_local  # noqa: E402

from dtrain.explain.plan import build_model  # noqa: E402
from dtrain.explain.precision import estimate  # noqa: E402
from dtrain.explain.predictor import target_at  # noqa: E402

PRECISION = "bf16-mixed"
SLOTS = (1, 2)


def predicted(source: Path, slots: int, curve: bool) -> tuple[float, float, float]:
    """samples/s of ``slots`` slots in bf16-mixed over the source run (80% interval), as the planner prices it."""
    profile, model = build_model(source, log=lambda line: None)  # a 1-slot source's link: probed, as plan does
    found = estimate(profile, PRECISION)
    if found.gain is None:
        raise SystemExit(f"{source}: {found.source}")
    target = target_at(model, slots, 1, **found.changes())
    if not curve:
        target = replace(target, precision_curve=None)
    base = model.predict(model.measured_target(), interval=False).samples_per_second
    p = model.predict(target)
    return p.samples_per_second / base, p.samples_per_second_low / base, p.samples_per_second_high / base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--hidden", type=int, default=480)
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    model = [f"hyperparameters.hidden={args.hidden}"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or Path(tmp)
        sources = {n: folder / f"source-{n}" for n in SLOTS}
        for n, path in sources.items():
            run_local(n, model, 4 * args.steps, path)

        def references(tag: str) -> dict[int, float]:
            return {n: run_local(n, model, args.steps, folder / f"ref-{tag}-{n}") for n in SLOTS}

        ratios: dict[tuple[int, int], list[float]] = {(k, n): [] for k in SLOTS for n in SLOTS}
        after = references("0")
        for r in range(args.rounds):
            before = after
            order = SLOTS if r % 2 == 0 else tuple(reversed(SLOTS))
            runs = {k: run_local(k, [*model, f"precision={PRECISION}"], args.steps, folder / f"r{r}-{k}")
                    for k in order}
            after = references(str(r + 1))
            for (k, n), found in ratios.items():
                found.append(runs[k] / math.sqrt(before[n] * after[n]))
        print(f"| {PRECISION} on | from the source | predicted, curve (80%) | error | predicted, gain carried "
              "(80%) | error | measured (rounds) |")
        print("|---|---|---|---|---|---|---|")
        for (k, n), found in ratios.items():
            measured = statistics.median(found)
            cells = []
            for curve in (True, False):
                value, low, high = predicted(sources[n], k, curve)
                held = "" if low <= measured <= high else ", misses"
                cells += [f"{value:.3f}x ({low:.3f}-{high:.3f}{held})", f"{100 * (value / measured - 1):+.1f}%"]
            rounds = ", ".join(f"{x:.3f}" for x in found)
            print(f"| {k} slot(s) | {n}-slot | {' | '.join(cells)} | {measured:.3f}x ({rounds}) |")


if __name__ == "__main__":
    main()
