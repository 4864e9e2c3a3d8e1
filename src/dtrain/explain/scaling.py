"""``dtrain bench``: the same trial at several slot counts, side by side, to measure scaling.

For each slot count N it runs short trainings of the trial:

* strong scaling: the config's global batch split over N slots (same work per step, more slots);
* weak scaling: N x the 1-slot global batch (same work per slot);
* with ``--synthetic``, each again with one real batch reused on the device, so data loading drops out:
  the real-vs-synthetic gap is the data-loading cost.

Absolute times drift on a shared machine; the runs of one bench are measured back to back so that their
ratios are comparable. With ``repeats`` R, every case runs R times in rounds (odd rounds in reverse order,
so drift hits every case alike); each case's samples/s is its median run, and every ratio (speed-up, weak
efficiency, data-loading gap) is the median of the R per-round ratios over the same round's 1-slot (or
real-data) run, beside their range (:mod:`dtrain.explain.paired`, shared with ``dtrain doctor --verify``).
With a round budget (``max_repeats``) rounds are added while a speed-up's range is wider than
``target_spread``; each row then says whether its range is narrow enough to rank by.

Every slot count gets the same thread rule (:mod:`dtrain.launcher.cpu`: cores // slots threads per slot); a user's
``OMP_NUM_THREADS`` is overridden, with the reason printed, since it would starve or oversubscribe some case.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import UserError
from dtrain.explain import paired
from dtrain.explain.render import as_text, pyplot
from dtrain.launcher import runs
from dtrain.profiling.record import load_profile


@dataclass(frozen=True)
class BenchCase:
    slots: int
    scaling: str  # "strong" | "weak"
    synthetic: bool

    @property
    def label(self) -> str:
        return f"{self.slots}slot-{self.scaling}-{'synthetic' if self.synthetic else 'real'}"


def parse_slots(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; anything else is a UserError naming the bad item."""
    items = [t.strip() for t in text.split(",")]
    counts = []
    for item in items:
        if not item.isdigit() or int(item) < 1:
            raise UserError(f"--slots expects a comma-separated list of positive integers like 1,2; got {text!r} "
                            f"({item!r} is not a positive integer)")
        counts.append(int(item))
    return sorted(set(counts))


def cases(slot_counts: list[int], synthetic: bool) -> list[BenchCase]:
    modes = [False, True] if synthetic else [False]
    out = []
    for n in slot_counts:
        for scaling in ("strong", "weak") if n > 1 else ("strong",):
            out.extend(BenchCase(n, scaling, mode) for mode in modes)
    return out


def run_case(config: Path, case: BenchCase, base_batch: int, steps: int, out: Path, overrides: list[str],
             debug: bool, threads: int | None = None) -> dict[str, Any]:
    batch = base_batch * case.slots if case.scaling == "weak" else base_batch
    sets = [*overrides, f"resources.slots_per_trial={case.slots}", f"max_length={{batches: {steps}}}",
            "min_validation_period=null", "min_checkpoint_period=null", f"scheduling_unit={steps}",
            f"hyperparameters.global_batch_size={batch}", f"data_loader.synthetic={str(case.synthetic).lower()}",
            "profiling.enabled=true"]
    plan = runs.prepare(config, sets, run_dir=out / case.label, resume=None)
    failure = runs.execute(plan, quiet=True, debug=debug, threads=threads)
    if failure is not None:
        raise RuntimeError(f"bench case {case.label}: rank {failure.rank} failed: {failure.message}")
    profile = load_profile(plan.run_dir / "profile.json")
    return {"slots": case.slots, "scaling": case.scaling, "synthetic": case.synthetic,
            "global_batch_size": profile.global_batch_size, "samples_per_second": profile.samples_per_second,
            "threads_per_slot": profile.threads_per_slot,
            "step_seconds": profile.seconds_per_step.step.mean, "run_dir": str(plan.run_dir)}


def _merge(runs_of_case: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's rounds: the median run's figures, and every round's samples/s."""
    ordered = sorted(runs_of_case, key=lambda r: r["samples_per_second"])
    return {**ordered[(len(ordered) - 1) // 2], "runs_samples_per_second": [r["samples_per_second"]
                                                                          for r in runs_of_case]}


def summarize(results: list[dict[str, Any]], target_spread: float = paired.DEFAULT_TARGET_SPREAD
              ) -> list[dict[str, Any]]:
    """One row per slot count: samples/s, speed-up (with its per-round range), strong and weak efficiency,
    data-loading gap; every ratio paired round by round."""
    def runs(slots: int, scaling: str, synthetic: bool) -> list[float]:
        for r in results:
            if (r["slots"], r["scaling"], r["synthetic"]) == (slots, scaling, synthetic):
                return r.get("runs_samples_per_second") or [r["samples_per_second"]]
        return []

    def sps(slots: int, scaling: str, synthetic: bool) -> float | None:
        return paired.median(runs(slots, scaling, synthetic))

    one = runs(1, "strong", False)
    rows = []
    for n in sorted({r["slots"] for r in results}):
        strong, weak = runs(n, "strong", False), runs(n, "weak", False) if n > 1 else runs(n, "strong", False)
        synth = runs(n, "strong", True)
        ratios = paired.ratios(strong, one)
        speedup = paired.summary(ratios, target_spread)
        weak_ratios = paired.ratios(weak, [n * b for b in one])
        real_over_synthetic = paired.median(paired.ratios(strong, synth))
        rows.append({
            "slots": n,
            "samples_per_second": sps(n, "strong", False),
            "speedup": speedup["median"],
            "speedup_ratios": ratios,
            "speedup_range": speedup["range"],
            "speedup_spread": speedup["spread"],
            "narrow": speedup["narrow"],
            "spread_verdict": speedup["spread_verdict"],
            "strong_efficiency": speedup["median"] / n if speedup["median"] else None,
            "weak_samples_per_second": paired.median(weak),
            "weak_efficiency": paired.median(weak_ratios),
            "synthetic_samples_per_second": paired.median(synth),
            "data_loading_gap": 1 - real_over_synthetic if real_over_synthetic is not None else None,
        })
    return rows


def render_table(rows: list[dict[str, Any]]) -> str:
    from rich.table import Table

    table = Table(title="dtrain bench (strong: same global batch; weak: global batch x slots)")
    cols = ("slots", "samples/s", "speed-up", "range", "strong eff.", "weak samples/s", "weak eff.",
            "synthetic samples/s", "data-loading gap")
    for col in cols:
        table.add_column(col, justify="right")

    def fmt(value: float | None, kind: str) -> str:
        if value is None:
            return "-"
        return {"sps": f"{value:,.0f}", "x": f"{value:.2f}x", "pct": f"{100 * value:.0f}%"}[kind]

    for r in rows:
        spread = r.get("speedup_range")
        table.add_row(str(r["slots"]), fmt(r["samples_per_second"], "sps"), fmt(r["speedup"], "x"),
                      f"{spread[0]:.2f}-{spread[1]:.2f}x" if spread and spread[0] != spread[1] else "-",
                      fmt(r["strong_efficiency"], "pct"), fmt(r["weak_samples_per_second"], "sps"),
                      fmt(r["weak_efficiency"], "pct"), fmt(r["synthetic_samples_per_second"], "sps"),
                      fmt(r["data_loading_gap"], "pct"))
    return as_text(table, width=140)


def plot_scaling(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    slots = [r["slots"] for r in rows]
    base = rows[0]["samples_per_second"] if rows and rows[0]["slots"] == 1 else None
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("samples_per_second", "strong (real data)"), ("weak_samples_per_second", "weak (real data)"),
                       ("synthetic_samples_per_second", "strong (synthetic data)")):
        ys = [r[key] for r in rows]
        if any(y is not None for y in ys):
            ax.plot(slots, [y if y is not None else float("nan") for y in ys], marker="o", label=label)
    if base:
        ax.plot(slots, [base * n for n in slots], linestyle="--", color="grey", label="linear (ideal)")
    ax.set_xlabel("slots")
    ax.set_ylabel("samples/s")
    ax.set_xticks(slots)
    ax.set_title("scaling")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bench(config: Path, slot_counts: list[int], synthetic: bool, steps: int, out: Path | None,
          overrides: list[str], debug: bool, repeats: int = 1, max_repeats: int | None = None,
          target_spread: float = paired.DEFAULT_TARGET_SPREAD) -> Path:
    """Run every case ``repeats`` times (then more, up to ``max_repeats``, while a speed-up's range is wider
    than ``target_spread``), write ``bench.json``, ``bench.txt`` and ``scaling.png`` under ``out``; return it."""
    if steps < 1:
        raise UserError(f"--steps must be >= 1, got {steps}")
    budget = paired.check_rounds(repeats, max_repeats, target_spread)
    from dtrain.config.model import samples_only_sets
    from dtrain.config.schema import load_config
    from dtrain.launcher import cpu

    cfg = load_config(config, overrides)
    overrides = [*samples_only_sets(cfg), *overrides]
    out = out or Path("runs") / f"bench-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    todo = cases(slot_counts, synthetic)
    threads = {n: cpu.for_bench(n) for n in slot_counts}
    for n, (count, reason) in threads.items():
        print(f"dtrain bench: {n} slot(s) x {count} thread(s)" + (f" ({reason})" if reason else ""), flush=True)
    measured: dict[BenchCase, list[dict[str, Any]]] = {case: [] for case in todo}
    planned = str(repeats) if budget == repeats else f"{repeats}-{budget}"
    rounds = 0

    def speedup_ratios() -> list[list[float]]:
        rows = summarize([_merge(measured[case]) for case in todo if measured[case]], target_spread)
        return [r["speedup_ratios"] for r in rows if r["slots"] > 1 and r["speedup_ratios"]]

    while paired.more_rounds(rounds, repeats, budget, speedup_ratios() if rounds else [], target_spread):
        for case in paired.order(todo, rounds):
            print(f"dtrain bench: [{rounds + 1}/{planned}] {case.label} ...", flush=True)
            folder = out / f"round{rounds}" if budget > 1 else out
            measured[case].append(run_case(config, case, cfg.global_batch_size, steps, folder, overrides, debug,
                                           threads[case.slots][0]))
        rounds += 1
    results = [_merge(measured[case]) for case in todo]
    rows = summarize(results, target_spread)
    table = render_table(rows) + _footer(rows, rounds)
    (out / "bench.json").write_text(json.dumps({
        "cases": results, "rows": rows, "repeats": repeats, "max_repeats": budget, "rounds": rounds,
        "target_spread": target_spread, "steps": steps, "median_confidence": paired.median_confidence(rounds),
        "noise": paired.noise(rounds)}, indent=2))
    (out / "bench.txt").write_text(table)
    plot_scaling(rows, out / "scaling.png")
    print(table, end="")
    print(f"dtrain bench: results in {out} (bench.json, bench.txt, scaling.png)")
    return out


def _footer(rows: list[dict[str, Any]], rounds: int) -> str:
    """Per slot count, whether its speed-up's range is narrow enough to rank by; then the noise line."""
    lines = "".join(f"{r['slots']} slots: {r['spread_verdict']}\n" for r in rows
                    if r["slots"] > 1 and r["speedup_ratios"] and rounds > 1)
    return lines + paired.footer(rounds, "1-slot (data-loading gap: synthetic-data) run")
