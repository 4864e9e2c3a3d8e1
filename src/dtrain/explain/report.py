"""A run's report: one self-contained HTML page (``RUN_DIR/report.html``) that explains where the time went.

The page needs no network: the charts are PNGs embedded as base64 data URIs and the CSS is inline, so
it can be copied off a cluster, mailed or archived with the run and still open. It reads only what the
run wrote (``config.yaml``, ``summary.json``, ``metrics.jsonl``, ``profile.json``) and renders what it
can: a run without a profile (profiling off, or not finished) still gets a page that says what is missing.
The markup is also well-formed XML (void elements self-closed, only XML entities): a strict parser checks it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dtrain.errors import UserError
from dtrain.explain import sharded
from dtrain.explain.diagnosis import Diagnosis, FactorRow
from dtrain.explain.doctor import diagnose
from dtrain.explain.membership_view import change_batches, esc, membership_section, slot_counts
from dtrain.explain.report_charts import plot_breakdown, plot_curves, plot_throughput
from dtrain.profiling.record import ProfileRecord, load_run_profile
from dtrain.profiling.runsummary import RunSummary, load_summary

REPORT_NAME = "report.html"
TOP_RECOMMENDATIONS = 3
# What a run directory holds that the page reads; a folder with none of them is not a run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "profile.json")
CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; padding: 0 1em; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 1.6em; }
dl.facts { display: flex; flex-wrap: wrap; gap: 0.2em 0.4em; margin: 0.4em 0; color: #555; }
dl.facts dt { font-weight: bold; } dl.facts dt::after { content: ":"; } dl.facts dd { margin: 0 1em 0 0; }
details summary { cursor: pointer; color: #4e79a7; }
pre { background: #f6f8fa; padding: 1em; overflow-x: auto; font-size: 0.85em; } img { max-width: 100%; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; } tr.top { background: #fff3cd; font-weight: bold; }
.note { background: #eef4fb; border-left: 4px solid #4e79a7; padding: 0.5em 1em; }
.verdict { font-size: 1.05em; background: #fff3cd; border-left: 4px solid #f0ad4e; padding: 0.5em 1em; }
"""


@dataclass
class _Run:
    """Everything the page shows, read once; ``None`` / empty where the run did not write it."""

    run_dir: Path
    name: str
    date: str | None
    config_text: str | None
    config: dict[str, Any]
    summary: RunSummary | None
    profile: ProfileRecord | None
    records: list[dict[str, Any]]
    missing: list[str] = field(default_factory=list)


def write_report(run_dir: Path) -> Path:
    """Render ``RUN_DIR/report.html`` and return its path.

    Missing or damaged inputs (no ``profile.json``, empty ``metrics.jsonl``, ...) are reported in the page,
    not raised; only a ``run_dir`` that is not a directory raises :class:`~dtrain.errors.UserError`.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory; pass a run directory made by 'dtrain run'")
    path = run_dir / REPORT_NAME
    partial = path.with_name(REPORT_NAME + ".partial")  # never leave a half-written page where one was
    partial.write_text(render_report(run_dir), encoding="utf-8")
    partial.replace(path)
    return path


def render_report(run_dir: Path) -> str:
    """The report page for ``run_dir`` as an HTML string (what :func:`write_report` writes)."""
    run = _load_run(Path(run_dir))
    # The answer first (the doctor's verdict and what to try), then where the time goes, then the curves;
    # the config, which the reader wrote and knows, last and folded.
    sections = [_header_section(run), _doctor_section(run), _breakdown_section(run), _throughput_section(run),
                _curves_section(run), membership_section(run.run_dir), _config_section(run)]
    return _page(run.name, "\n".join(sections))


# --------------------------------------------------------------------------------------------- loading

def _load_run(run_dir: Path) -> _Run:
    missing: list[str] = []
    config_text = _read_text(run_dir / "config.yaml", missing)
    config = _parse_config(config_text)
    summary = _read_summary(run_dir / "summary.json", missing)
    records = _read_metrics(run_dir / "metrics.jsonl", missing)
    profile = _read_profile(run_dir, missing)
    name = str(config.get("name") or run_dir.name)
    return _Run(run_dir, name, _run_date(run_dir), config_text, config, summary, profile, records, missing)


def _read_text(path: Path, missing: list[str]) -> str | None:
    if not path.is_file():
        missing.append(f"{path.name} is missing")
        return None
    return path.read_text(encoding="utf-8", errors="replace")


def _parse_config(text: str | None) -> dict[str, Any]:
    # The page shows the raw text anyway; parsing only supplies the name and slots, so a bad file is not fatal.
    try:
        config = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return {}
    return config if isinstance(config, dict) else {}


def _read_summary(path: Path, missing: list[str]) -> RunSummary | None:
    if not path.is_file():
        missing.append(f"{path.name} is missing")
        return None
    try:
        return load_summary(path)
    except UserError:
        missing.append(f"{path.name} is empty or corrupt")
        return None


def _read_metrics(path: Path, missing: list[str]) -> list[dict[str, Any]]:
    text = _read_text(path, missing)
    if text is None:
        return []
    records, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad += 1  # e.g. the last line of a run still writing it
            continue
        if isinstance(record, dict) and isinstance(record.get("batches"), (int, float)):
            records.append(record)
        else:
            bad += 1
    if bad:
        missing.append(f"metrics.jsonl: {bad} unreadable line(s) skipped")
    if not records:
        missing.append("metrics.jsonl has no training or validation records")
    return records


def _read_profile(run_dir: Path, missing: list[str]) -> ProfileRecord | None:
    # load_run_profile validates the structure the breakdown and the doctor rely on; its message says why not.
    try:
        return load_run_profile(run_dir)
    except UserError as exc:
        missing.append(f"no step profile: {exc}")
        return None


def _run_date(run_dir: Path) -> str | None:
    # The run directory records no start time; the newest of its files is when these results were written.
    times = [(run_dir / n).stat().st_mtime for n in RUN_FILES if (run_dir / n).is_file()]
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(max(times))) if times else None


# --------------------------------------------------------------------------------------------- formatting


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if _finite(value) else "n/a"


def _ms(seconds: Any) -> str:
    return _fmt(1e3 * seconds, ".3f") if _finite(seconds) else "n/a"


def _bytes(value: Any) -> str:
    if not _finite(value):
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def _speedup(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and math.isinf(value):
        return "∞"  # the factor is the whole step; removing it is unbounded in the model
    return _fmt(value, ".2f") + "x"


def _note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def _table(headers: list[str], rows: list[list[str]], numeric: set[int], row_classes: list[str] | None = None) -> str:
    """An HTML table from already-escaped cell strings; columns in ``numeric`` are right-aligned."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        cells = "".join(f'<td class="num">{c}</td>' if j in numeric else f"<td>{c}</td>" for j, c in enumerate(row))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _img(data_uri: str, alt: str) -> str:
    return f'<img src="{data_uri}" alt="{esc(alt)}" />'


def _page(name: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8" />\n'
            f"<title>dtrain report: {esc(name)}</title>\n<style>{CSS}</style>\n</head>\n"
            f"<body>\n{body}\n</body>\n</html>\n")


# --------------------------------------------------------------------------------------------- sections


def _header_section(run: _Run) -> str:
    facts = [("run", run.name), ("date", run.date or "unknown"), ("run directory", str(run.run_dir)),
             ("slots", _slots(run)), ("samples/s", _samples_per_second(run)),
             ("final validation", _final_validation(run))]
    items = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in facts)
    notes = ""
    if run.missing:
        notes = ('<div class="note"><p>This report is incomplete:</p><ul>'
                 + "".join(f"<li>{esc(m)}</li>" for m in run.missing) + "</ul></div>")
    return f'<header>\n<h1>dtrain run: {esc(run.name)}</h1>\n<dl class="facts">{items}</dl>\n{notes}\n</header>'


def _slots(run: _Run) -> str:
    worlds = slot_counts(run.run_dir)
    if len(worlds) > 1:  # an elastic run: the profile's slot count is the last world's only
        return " -> ".join(map(str, worlds)) + " (nodes changed: see Membership changes)"
    if run.profile is not None:
        return str(run.profile.slots)
    if run.summary is not None:
        return str(run.summary.slots)
    resources = run.config.get("resources")
    return str(resources.get("slots_per_trial", "unknown")) if isinstance(resources, dict) else "unknown"


def _samples_per_second(run: _Run) -> str:
    profiled = run.profile.samples_per_second if run.profile is not None else None
    for value in (run.summary.samples_per_second if run.summary is not None else None, profiled):
        if _finite(value):
            return f"{value:,.0f}"
    training = [r for r in run.records if r.get("kind") == "training" and _finite(r.get("samples_per_second"))]
    return f"{training[-1]['samples_per_second']:,.0f} (last training report)" if training else "unknown"


def _final_validation(run: _Run) -> str:
    metrics = run.summary.validation if run.summary is not None else None
    if not isinstance(metrics, dict):  # the run has not finished: fall back to its last validation
        validation = [r for r in run.records if r.get("kind") == "validation"]
        metrics = validation[-1].get("metrics") if validation else None
    if not isinstance(metrics, dict) or not metrics:
        return "none recorded"
    return ", ".join(f"{k} {_fmt(v, '.4g')}" for k, v in metrics.items())


def _config_section(run: _Run) -> str:
    script = run.profile.script if run.profile is not None else None
    if run.config_text is None and script is not None:  # a script's run (dtrain launch SCRIPT): what ran, and where
        facts = [f"{script.launcher}: {' '.join(script.command)}", f"in {script.cwd}",
                 f"sha256 {script.script_sha256}", *(f"not seen: {line}" for line in script.unseen)]
        content = f"<pre>{esc(chr(10).join(facts))}</pre>"
        return f'<section id="config">\n<h2>Script</h2>\n{content}\n</section>'
    if run.config_text is None:
        content = _note("config.yaml is missing.")
    else:
        lines = len(run.config_text.splitlines())
        content = (f"<details>\n<summary>The resolved config ({lines} lines of config.yaml)</summary>\n"
                   f"<pre>{esc(run.config_text)}</pre>\n</details>")
    return f'<section id="config">\n<h2>Config</h2>\n{content}\n</section>'


def _breakdown_section(run: _Run) -> str:
    title = '<section id="breakdown">\n<h2>Where a step\'s time goes</h2>\n'
    if run.profile is None:
        return title + _note("No step profile (profile.json): the run has not finished or ran with "
                             "profiling.enabled: false, so there is no time breakdown.") + "\n</section>"
    chart = _img(plot_breakdown(run.profile), "stacked bar of ms per step per phase, one bar per rank")
    if not run.profile.phases_observed:  # the chart's zero phases are unseen, not free
        from dtrain.explain.doctor import unobserved_note

        chart = _note(unobserved_note(run.profile)) + "\n" + chart
    return (f"{title}{chart}\n<h3>Per phase across ranks (ms / step)</h3>\n{_phase_table(run.profile)}\n"
            f"{_straggler_table(run.profile)}<h3>Communication</h3>\n{_comm_table(run.profile)}\n</section>")


def _straggler_table(profile: ProfileRecord) -> str:
    """How late each rank arrives at the gradient all-reduce (profile.json's ``stragglers``)."""
    lags = profile.stragglers
    if lags is None or not lags.per_rank:
        return ""
    rows = [[esc(r.rank), esc(r.host), _ms(r.lag_median_seconds), _ms(r.lag_p90_seconds),
             _fmt(100 * r.last_fraction, ".0f") + "%", esc(r.slow_phase),
             _ms(r.slow_phase_excess_seconds), "chronic" if r.chronic else ""]
            for r in lags.per_rank]
    headers = ["rank", "host", "lag median", "lag p90", "arrived last", "slowest phase", "behind fastest", ""]
    return (f"<h3>Arrival at the gradient all-reduce ({esc(lags.samples)} sampled steps; ms)</h3>\n"
            f"{_table(headers, rows, numeric={2, 3, 4, 6})}\n")


def _phase_table(profile: ProfileRecord) -> str:
    rows = [[esc(phase), _ms(s.min), _ms(s.mean), _ms(s.max)] for phase, s in profile.seconds_per_step.items()]
    return _table(["phase", "min", "mean", "max"], rows, numeric={1, 2, 3})


def _comm_table(profile: ProfileRecord) -> str:
    comm = profile.comm
    if not profile.comm_measured:  # FSDP: its collectives run inside forward and backward, timed there
        probed = sharded.probe_words(profile)
        return _note(f"Not timed: sync.strategy {profile.strategy} communicates inside forward and backward"
                     + (f"; {probed}." if probed else "."))
    figures = [("bytes / step", _bytes(comm.bytes_per_step)),
               ("all-reduces / step", _fmt(comm.buckets_per_step, ".0f")),
               ("busy ms / step", _ms(comm.busy_seconds_per_step)),
               ("exposed ms / step", _ms(comm.exposed_seconds_per_step)),
               ("algbw", _bytes(comm.algbw_bytes_per_second) + "/s"),
               ("busbw", _bytes(comm.busbw_bytes_per_second) + "/s"),
               ("latency ms (one float)", _ms(comm.latency_seconds))]
    return _table(["figure", "value"], [[esc(label), esc(value)] for label, value in figures], numeric={1})


def _throughput_section(run: _Run) -> str:
    title = '<section id="throughput">\n<h2>Throughput</h2>\n'
    points = [(r["batches"], r["samples_per_second"]) for r in run.records
              if r.get("kind") == "training" and _finite(r.get("samples_per_second"))]
    if not points:
        return title + _note("No training records with samples/s in metrics.jsonl.") + "\n</section>"
    mean = run.profile.samples_per_second if run.profile is not None else None
    plot = plot_throughput(points, mean, change_batches(run.run_dir))
    return title + _img(plot, "samples per second vs batches") + "\n</section>"


def _curves_section(run: _Run) -> str:
    title = '<section id="curves">\n<h2>Loss and metrics</h2>\n'
    series = {kind: _metric_series(run.records, kind) for kind in ("training", "validation")}
    if not any(series.values()):
        return title + _note("No training or validation metrics in metrics.jsonl.") + "\n</section>"
    absent = [kind for kind, s in series.items() if not s]
    notes = "".join(_note(f"No {kind} metrics recorded yet.") for kind in absent)
    return title + notes + _img(plot_curves(series), "training and validation metrics vs batches") + "\n</section>"


def _metric_series(records: list[dict[str, Any]], kind: str) -> dict[str, tuple[list[float], list[float]]]:
    """``{metric: (batches, values)}`` for one record kind; null or non-finite values become NaN (a gap)."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for record in records:
        metrics = record.get("metrics")
        if record.get("kind") != kind or not isinstance(metrics, dict):
            continue
        for name, value in metrics.items():
            xs, ys = series.setdefault(str(name), ([], []))
            xs.append(record["batches"])
            ys.append(value if _finite(value) else math.nan)
    return series


def _doctor_section(run: _Run) -> str:
    title = '<section id="doctor">\n<h2>Doctor\'s verdict</h2>\n'
    if run.profile is None:
        return title + _note("The doctor needs profile.json; see the note above.") + "\n</section>"
    try:
        diagnosis = diagnose(run.profile)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a profile the doctor cannot model
        return title + _note(f"The doctor could not diagnose this profile: {exc!r}") + "\n</section>"
    return (f'{title}<p class="verdict" id="verdict">{esc(diagnosis.verdict)}</p>\n'
            f"{''.join(map(_note, diagnosis.efficiency.lines))}{_recommendation_list(diagnosis)}\n"
            f"{_scaling_line(diagnosis)}\n<h3>Every factor</h3>\n{_factor_table(diagnosis)}\n</section>")


def _factor_table(diagnosis: Diagnosis) -> str:
    rows, classes = [], []
    for f in diagnosis.factors:
        rows.append([esc(f.factor), _fmt(100 * f.share, ".0f") + "%", _ms(f.seconds_per_step),
                     _action(f), esc(_speedup(f.predicted_speedup) if f.advice.bound is None
                                      else f"at most {f.advice.bound:.2f}x (a bound)"), esc(f.why)])
        classes.append("top" if f.factor == diagnosis.top_factor else "")
    headers = ["factor", "share", "ms / step", "what to try", "predicted speed-up", "why"]
    return _table(headers, rows, numeric={1, 2, 4}, row_classes=classes)


def _action(factor: FactorRow) -> str:
    if factor.key is None:
        return "—"
    text = f"<code>{esc(factor.key)}: {esc(factor.value)}</code>"
    if alt := factor.advice.alternative:
        text += (f"<br />or <code>{esc(alt.key)}: {esc(alt.value)}</code> "
                 f"({esc(_speedup(alt.predicted_speedup))})")
    return text


def _recommendation_list(diagnosis: Diagnosis) -> str:
    recs = diagnosis.recommendations
    if not recs:
        if not diagnosis.phases_observed:  # the verdict says why there is nothing to predict
            return ""
        return "<p>No config change is predicted to help by more than 2%.</p>"
    items = "".join(f"<li><code>{esc(r.action)}</code> ({esc(_speedup(r.predicted_speedup))}, "
                    f"{esc(r.factor)})</li>" for r in recs[:TOP_RECOMMENDATIONS])
    more = len(recs) - TOP_RECOMMENDATIONS
    tail = f"<p>{more} more in the table below.</p>" if more > 0 else ""
    # The doctor's order, not re-sorted: it puts "fewer slots" first when more slots are slower than one.
    return f"<h3>Try first</h3>\n<ol>{items}</ol>{tail}"


def _scaling_line(diagnosis: Diagnosis) -> str:
    if (scaling := diagnosis.scaling).estimated_speedup_vs_one_slot is None:
        return ""
    return (f"<p>Estimated scaling: {esc(_fmt(scaling.estimated_speedup_vs_one_slot, '.2f'))}x one slot's "
            f"samples/s (efficiency {esc(_fmt(100 * (scaling.estimated_scaling_efficiency or 0.0), '.0f'))}%).</p>")
