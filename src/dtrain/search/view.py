"""What a search shows: a live table while it runs; at the end the trials table, ``trials.json``,
``best.yaml`` (runnable with ``dtrain run``), ``search.png`` (metric vs batches per trial) and
``search.html`` (all of it on one self-contained page)."""

from __future__ import annotations

import base64
import html
import io
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from dtrain.explain.render import as_text, pyplot
from dtrain.search.space import SearchPlan

# Optuna's trial states in Determined's words: a pruned trial is one ASHA stopped.
STATES = {"COMPLETE": "completed", "PRUNED": "stopped", "FAIL": "failed", "RUNNING": "interrupted",
          "WAITING": "waiting"}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return "-" if value is None else str(value)


def trials_table(rows: list[dict[str, Any]], plan: SearchPlan, title: str) -> Table:
    """One row per trial: its hyperparameters, last metric, batches trained and state."""
    names = list(plan.space.searched)
    table = Table(title=title)
    for col in ("trial", *names, plan.searcher.metric, "batches", "state"):
        table.add_column(col, justify="left" if col == "state" else "right")
    for r in rows:
        state = r["state"] + (f" ({r['note']})" if r.get("note") else "")
        table.add_row(str(r["trial"]), *(_fmt(r["hyperparameters"].get(n)) for n in names), _fmt(r["value"]),
                      _fmt(r["batches"]), state)
    return table


class Progress:
    """A live table on a terminal; one line per event otherwise (logs, CI, tests)."""

    def __init__(self, plan: SearchPlan) -> None:
        self.plan = plan
        self._live: Live | None = None
        self._drawn = 0.0
        if sys.stdout.isatty():
            # No auto-refresh thread: trials are started with preexec_fn, which wants no other threads.
            # Transient: the final table replaces it when the search ends.
            self._live = Live(console=Console(), auto_refresh=False, transient=True)
            self._live.start()

    def event(self, text: str) -> None:
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            print(f"dtrain search: {text}", flush=True)

    def update(self, rows_of: Callable[[], list[dict[str, Any]]], running: int, slots: int) -> None:
        """Redraw the live table (at most once a second: ``rows_of`` reads every trial's metrics)."""
        if self._live is not None and time.monotonic() - self._drawn >= 1.0:
            self._drawn = time.monotonic()
            rows = rows_of()
            done = sum(r["state"] in ("completed", "stopped", "failed") for r in rows)
            title = (f"dtrain search: {done}/{self.plan.max_trials} trials done, {running} running on {slots} "
                     f"slot(s)")
            self._live.update(trials_table(rows, self.plan, title), refresh=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


# ------------------------------------------------------------------------------------------ at the end


def trial_rows(study: Any, plan: SearchPlan, out: Path) -> list[dict[str, Any]]:
    """Every trial of the study, as stored: what the final table, JSON, PNG and HTML show."""
    rows = []
    for ft in study.get_trials(deepcopy=False):
        steps = ft.intermediate_values
        last = max(steps) if steps else None
        value = ft.value if ft.state.name == "COMPLETE" else (steps[last] if last is not None else None)
        run_dir = out / "trials" / str(ft.number)
        rows.append({
            "trial": ft.number,
            "hyperparameters": dict(ft.params),
            "state": STATES.get(ft.state.name, ft.state.name.lower()),
            "value": value if value is not None and math.isfinite(value) else None,
            "batches": ft.user_attrs.get("batches"),
            f"trained_{plan.unit}": last,
            "error": ft.user_attrs.get("error"),
            "run_dir": str(run_dir),
            "curve": _curve(run_dir / "metrics.jsonl", plan.searcher.metric),
        })
    return rows


def _curve(path: Path, metric: str) -> list[tuple[int, float]]:
    if not path.is_file():
        return []
    points = []
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        value = record.get("metrics", {}).get(metric) if record.get("kind") == "validation" else None
        if value is not None:
            points.append((int(record["batches"]), float(value)))
    return points


def best_row(rows: list[dict[str, Any]], plan: SearchPlan) -> dict[str, Any] | None:
    """The completed trial with the best final metric (the earliest on a tie)."""
    done = [r for r in rows if r["state"] == "completed" and r["value"] is not None]
    if not done:
        return None
    sign = 1 if plan.searcher.smaller_is_better else -1
    return min(done, key=lambda r: (sign * r["value"], r["trial"]))


def write_outputs(study: Any, plan: SearchPlan, out: Path, wall_seconds: float) -> dict[str, Any]:
    """Write trials.json/.txt, best.yaml, search.png and search.html; return the JSON's content."""
    rows = trial_rows(study, plan, out)
    best = best_row(rows, plan)
    s = plan.searcher
    result = {
        "searcher": s.name, "metric": s.metric, "smaller_is_better": s.smaller_is_better,
        "unit": plan.unit, "rungs": list(plan.lengths), "max_trials": plan.max_trials,
        "brackets": [{"rungs": list(ls), "trials": n} for ls, n in zip(plan.brackets.lengths,  # type: ignore[union-attr]
                                                                        plan.brackets.trials, strict=True)],
        "total_batches": sum(r["batches"] or 0 for r in rows),
        "best": None if best is None else {k: best[k] for k in ("trial", "hyperparameters", "value", "batches")},
        "wall_seconds_last_invocation": wall_seconds,
        "trials": [{k: v for k, v in r.items() if k != "curve"} for r in rows],
    }
    (out / "trials.json").write_text(json.dumps(result, indent=2))
    text = as_text(trials_table(rows, plan, f"dtrain search: {s.name}, {len(rows)} trial(s)"), width=160)
    (out / "trials.txt").write_text(text)
    if best is not None:
        trial_yaml = Path(best["run_dir"]) / "trial.yaml"
        header = (f"# Best trial of the search in {out}: trial {best['trial']}, {s.metric} {_fmt(best['value'])} "
                  f"after {best['batches']} batches.\n# Run it with: dtrain run {out / 'best.yaml'}\n")
        (out / "best.yaml").write_text(header + trial_yaml.read_text())
    png = plot(rows, plan, best)
    (out / "search.png").write_bytes(png)
    (out / "search.html").write_text(render_html(result, rows, plan, best, png))
    return result


def plot(rows: list[dict[str, Any]], plan: SearchPlan, best: dict[str, Any] | None) -> bytes:
    """Metric vs batches, one line per trial: solid completed, dashed stopped, the best one thick."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    colors = plt.get_cmap("tab20")
    for i, r in enumerate(rows):
        if not r["curve"]:
            continue
        xs, ys = zip(*r["curve"], strict=True)
        is_best = best is not None and r["trial"] == best["trial"]
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=3 if is_best else 1.2, color=colors(i % 20),
                linestyle="--" if r["state"] == "stopped" else "-", alpha=1.0 if is_best else 0.75,
                label=f"trial {r['trial']}" + (" (best)" if is_best else ""))
    ax.set_xlabel("batches trained")
    ax.set_ylabel(f"validation {plan.searcher.metric}")
    ax.set_title(f"dtrain search ({plan.searcher.name}): dashed = stopped early")
    ax.grid(alpha=0.3)
    if len(rows) <= 16 and any(r["curve"] for r in rows):
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def render_html(result: dict[str, Any], rows: list[dict[str, Any]], plan: SearchPlan, best: dict[str, Any] | None,
                png: bytes) -> str:
    from dtrain.explain.report import CSS  # the run report's look

    esc = html.escape
    names = list(plan.space.searched)
    facts = [("searcher", plan.searcher.name), ("metric", f"{plan.searcher.metric} "
             f"({'smaller' if plan.searcher.smaller_is_better else 'larger'} is better)"),
             ("trials", str(len(rows))), ("rung lengths", f"{plan.rungs_text()} {plan.unit}"),
             ("batches trained, all trials", f"{result['total_batches']:,}"),
             ("best", "none completed" if best is None else f"trial {best['trial']}: {_fmt(best['value'])}"),
             ("written", time.strftime("%Y-%m-%d %H:%M:%S"))]
    items = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in facts)
    head = "".join(f"<th>{esc(c)}</th>" for c in ("trial", *names, plan.searcher.metric, "batches", "state"))
    body = []
    for r in rows:
        cls = ' class="top"' if best is not None and r["trial"] == best["trial"] else ""
        cells = [str(r["trial"]), *(_fmt(r["hyperparameters"].get(n)) for n in names), _fmt(r["value"]),
                 _fmt(r["batches"]), r["state"] + (f": {r['error']}" if r["error"] else "")]
        body.append(f"<tr{cls}>" + "".join(f'<td class="num">{esc(c)}</td>' for c in cells[:-1])
                    + f"<td>{esc(cells[-1])}</td></tr>")
    best_yaml = ""
    if best is not None:
        text = (Path(best["run_dir"]) / "trial.yaml").read_text()
        best_yaml = f"<h2>Best config (best.yaml)</h2>\n<pre>{esc(text)}</pre>"
    image = base64.b64encode(png).decode()
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8"/>\n'
            f"<title>dtrain search: {esc(plan.config.name)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            f"<h1>dtrain search: {esc(plan.config.name)}</h1>\n<dl class=\"facts\">{items}</dl>\n"
            f"<h2>Validation {esc(plan.searcher.metric)} per trial</h2>\n"
            f'<img src="data:image/png;base64,{image}" alt="metric vs batches per trial"/>\n'
            f"<h2>Trials</h2>\n<table><tr>{head}</tr>{''.join(body)}</table>\n{best_yaml}\n</body>\n</html>\n")
