"""An elastic run's membership changes on the report page: a table row per change and every slot count."""

from __future__ import annotations

import json

from dtrain.explain import report, report_charts
from dtrain.explain.membership_view import change_batches, doctor_note, membership_section, slot_counts
from dtrain.explain.report import render_report

RECORDS = [
    {"kind": "membership", "batches": 9, "cause": "join", "node": "vm-10.0.0.2-1", "old_world_size": 1,
     "new_world_size": 2, "seconds": 4.0, "lost_batches": 0, "event_time": 1_700_000_000.0},
    {"kind": "membership", "batches": 47, "cause": "lost", "node": "vm-10.0.0.2-1", "old_world_size": 2,
     "new_world_size": 1, "seconds": 8.2, "lost_batches": 0, "event_time": 1_700_000_030.0,
     "recovered_from": "survivors"},
    {"kind": "membership", "batches": 80, "cause": "lost", "node": "vm-10.0.0.3-1", "old_world_size": 2,
     "new_world_size": 1, "seconds": 9.0, "lost_batches": 12, "event_time": 1_700_000_060.0,
     "recovered_from": "checkpoint", "fallback_reason": "sync.strategy fsdp keeps part of the state on each rank"},
]


def test_each_change_is_a_row_and_the_note_names_every_slot_count(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    section = membership_section(tmp_path)
    assert "trained at 1, 2, 1 slot(s) in turn" in section and "changed 3 time(s)" in section
    assert section.count("<tr>") == 4  # the header and three changes
    assert "<td>joined</td><td>1 -&gt; 2</td><td>9</td><td>4.0</td><td>0</td>" in section
    assert "<td>went away (crash)</td><td>2 -&gt; 1</td><td>47</td><td>8.2</td><td>0</td><td>the survivors&#x27; " \
           "state</td>" in section
    assert "the latest checkpoint (sync.strategy fsdp keeps part of the state on each rank)" in section
    assert 'id="membership"' in render_report(tmp_path)
    assert doctor_note(tmp_path) == ("membership: this run trained at 1, 2, 1 slot(s) in turn (3 change(s); see "
                                     "report.html); the figures above are the last world's, from batch 80 on 1 "
                                     "slot(s)\n")


def test_a_run_without_changes_has_no_section(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "training", "batches": 8}) + "\n")
    assert membership_section(tmp_path) == "" and doctor_note(tmp_path) == ""
    assert 'id="membership"' not in render_report(tmp_path)
    assert slot_counts(tmp_path) == [] and change_batches(tmp_path) == []


def test_the_header_names_every_slot_count_and_the_chart_marks_each_change(tmp_path, monkeypatch):
    training = [{"kind": "training", "batches": b, "samples_per_second": 100.0} for b in (8, 16, 48, 64, 96)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [*training, *RECORDS]) + "\n")
    assert slot_counts(tmp_path) == [1, 2, 1] and change_batches(tmp_path) == [9, 47, 80]
    assert report_charts.plot_throughput([(8, 100.0), (16, 90.0)], 95.0, [9]).startswith("data:image/png;base64,")
    marks = []
    monkeypatch.setattr(report, "plot_throughput", lambda points, mean, changes: marks.append(changes) or "x")
    page = render_report(tmp_path)
    assert "<dt>slots</dt><dd>1 -&gt; 2 -&gt; 1 (nodes changed: see Membership changes)</dd>" in page
    assert marks == [[9, 47, 80]]
