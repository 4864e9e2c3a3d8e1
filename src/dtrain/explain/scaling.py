"""``dtrain bench``: the same trial at several slot counts, side by side, to measure scaling.

For each slot count N it runs short trainings of the trial:

* strong scaling: the config's global batch split over N slots (same work per step, more slots);
* weak scaling: N x the 1-slot global batch (same work per slot);
* with ``--synthetic``, each again with one real batch reused on the device, so data loading drops out:
  the real-vs-synthetic gap is the data-loading cost.

Absolute times drift on a shared machine; the runs of one bench are measured back to back so that their
ratios are comparable. With ``repeats`` R, every case runs R times in rounds (odd rounds in reverse order,
so drift hits every case alike); each case counts with its median, and each speed-up is the median of the
R per-round ratios, beside their range: the chance that the true median lies between the smallest and
largest of R independent measurements is ``1 - 2 x 0.5**R`` (75% for 3, 94% for 5), which bench states.

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


def median_confidence(repeats: int) -> float:
    """Probability that the median lies between the min and max of ``repeats`` independent samples."""
    return 1 - 2 * 0.5 ** repeats if repeats > 1 else 0.0


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


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per slot count: samples/s, speed-up, strong and weak efficiency, data-loading gap."""
    def sps(slots: int, scaling: str, synthetic: bool) -> float | None:
        for r in results:
            if (r["slots"], r["scaling"], r["synthetic"]) == (slots, scaling, synthetic):
                return r["samples_per_second"]
        return None

    def paired(slots: int) -> list[float]:
        """Per-round speed-ups over the same round's 1-slot run."""
        mine = next((r for r in results if (r["slots"], r["scaling"], r["synthetic"]) == (slots, "strong", False)), {})
        one = next((r for r in results if (r["slots"], r["scaling"], r["synthetic"]) == (1, "strong", False)), {})
        pairs = zip(mine.get("runs_samples_per_second", []), one.get("runs_samples_per_second", []), strict=False)
        return sorted(a / b for a, b in pairs if b)

    base = sps(1, "strong", False)
    rows = []
    for n in sorted({r["slots"] for r in results}):
        strong, weak = sps(n, "strong", False), sps(n, "weak", False) if n > 1 else sps(n, "strong", False)
        synth = sps(n, "strong", True)
        ratios = paired(n)
        speedup = ratios[(len(ratios) - 1) // 2] if ratios else (strong / base if base and strong else None)
        rows.append({
            "slots": n,
            "samples_per_second": strong,
            "speedup": speedup,
            "speedup_range": [ratios[0], ratios[-1]] if ratios else None,
            "strong_efficiency": speedup / n if speedup else None,
            "weak_samples_per_second": weak,
            "weak_efficiency": weak / (n * base) if base and weak else None,
            "synthetic_samples_per_second": synth,
            "data_loading_gap": 1 - strong / synth if synth and strong else None,
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
          overrides: list[str], debug: bool, repeats: int = 1) -> Path:
    """Run every case ``repeats`` times, write ``bench.json``, ``bench.txt`` and ``scaling.png`` under
    ``out``; return it."""
    if steps < 1:
        raise UserError(f"--steps must be >= 1, got {steps}")
    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    from dtrain.config.schema import load_config
    from dtrain.launcher import cpu

    cfg = load_config(config, overrides)
    out = out or Path("runs") / f"bench-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    todo = cases(slot_counts, synthetic)
    threads = {n: cpu.for_bench(n) for n in slot_counts}
    for n, (count, reason) in threads.items():
        print(f"dtrain bench: {n} slot(s) x {count} thread(s)" + (f" ({reason})" if reason else ""), flush=True)
    measured: dict[BenchCase, list[dict[str, Any]]] = {case: [] for case in todo}
    for round_ in range(repeats):
        for case in todo if round_ % 2 == 0 else list(reversed(todo)):
            print(f"dtrain bench: [{round_ + 1}/{repeats}] {case.label} ...", flush=True)
            folder = out / f"round{round_}" if repeats > 1 else out
            measured[case].append(run_case(config, case, cfg.global_batch_size, steps, folder, overrides, debug,
                                           threads[case.slots][0]))
    results = [_merge(measured[case]) for case in todo]
    rows = summarize(results)
    table = render_table(rows)
    if repeats > 1:
        table += (f"speed-up: median of {repeats} per-round ratios over the same round's 1-slot run; the range "
                  f"holds the true median with {100 * median_confidence(repeats):.0f}% confidence\n")
    (out / "bench.json").write_text(json.dumps({"cases": results, "rows": rows, "repeats": repeats, "steps": steps,
                                                "median_confidence": median_confidence(repeats)}, indent=2))
    (out / "bench.txt").write_text(table)
    plot_scaling(rows, out / "scaling.png")
    print(table, end="")
    print(f"dtrain bench: results in {out} (bench.json, bench.txt, scaling.png)")
    return out
