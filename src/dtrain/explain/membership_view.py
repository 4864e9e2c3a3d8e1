"""An elastic job's membership changes on the report page: one table row per change, and the slot counts
the run trained at (the page's header gives the last world's only).

The records are the launcher's (:mod:`dtrain.launcher.membership`), read back from ``metrics.jsonl``.
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

from dtrain.engine.metrics import membership_records

# How each cause reads in the table.
CAUSES = {"join": "joined", "leave": "left (signal)", "lost": "went away (crash)"}
HEADERS = ["when", "node", "what happened", "world size", "at batch", "seconds to train again", "batches lost",
           "continued from"]


def membership_section(run_dir: Path) -> str:
    """The report's section for the run's membership changes; empty where the run had none."""
    records = membership_records(Path(run_dir))
    if not records:
        return ""
    worlds = _worlds(records)
    note = (f"This run trained at {', '.join(str(w) for w in worlds)} slot(s) in turn: its nodes changed "
            f"{len(records)} time(s). The figures above (samples/s, the step breakdown) are the last world's.")
    rows = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in _row(r)) + "</tr>" for r in records)
    head = "".join(f"<th>{esc(h)}</th>" for h in HEADERS)
    return (f'<section id="membership">\n<h2>Membership changes</h2>\n<p class="note">{esc(note)}</p>\n'
            f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>\n</section>")


def slot_counts(run_dir: Path) -> list[int]:
    """The slot counts the run trained at, in order; one entry (or none) where its nodes never changed."""
    records = membership_records(Path(run_dir))
    return _worlds(records) if records else []


def change_batches(run_dir: Path) -> list[int]:
    """The batch at which each membership change took effect, for marks on the throughput chart."""
    return [r["batches"] for r in membership_records(Path(run_dir)) if isinstance(r.get("batches"), int)]


def doctor_note(run_dir: Path) -> str:
    """``dtrain doctor``'s line for a run whose nodes changed (its profile is the last world's), else ""."""
    records = membership_records(Path(run_dir))
    if not records:
        return ""
    last = records[-1]
    worlds = ", ".join(str(w) for w in _worlds(records))
    return (f"membership: this run trained at {worlds} slot(s) in turn ({len(records)} change(s); see report.html); "
            f"the figures above are the last world's, from batch {last.get('batches', '?')} on "
            f"{last.get('new_world_size', '?')} slot(s)\n")


def _worlds(records: list[dict[str, Any]]) -> list[int]:
    """The world sizes in the order the run trained at them (the first world's, then each change's)."""
    first = records[0].get("old_world_size")
    worlds = [first] if isinstance(first, int) else []
    for record in records:
        new = record.get("new_world_size")
        if isinstance(new, int) and (not worlds or worlds[-1] != new):
            worlds.append(new)
    return worlds


def _row(record: dict[str, Any]) -> list[str]:
    when = record.get("event_time")
    old = record.get("old_world_size")
    recovered = record.get("recovered_from")
    source = {"survivors": "the survivors' state", "checkpoint": "the latest checkpoint"}.get(str(recovered), "")
    if recovered == "checkpoint" and record.get("fallback_reason"):
        source += f" ({record['fallback_reason']})"
    elif not source:
        source = "a checkpoint at the agreed batch" if record.get("cause") in ("join", "leave") else ""
    return [time.strftime("%H:%M:%S", time.localtime(float(when))) if isinstance(when, (int, float)) else "?",
            str(record.get("node", "?")), CAUSES.get(str(record.get("cause")), str(record.get("cause"))),
            f"{old if old is not None else '?'} -> {record.get('new_world_size', '?')}",
            str(record.get("batches", "?")), f"{float(record.get('seconds', 0)):.1f}",
            str(record.get("lost_batches", 0)), source]


def esc(value: Any) -> str:
    """``value`` as HTML text (the report's cells and notes too)."""
    return html.escape(str(value), quote=True)
