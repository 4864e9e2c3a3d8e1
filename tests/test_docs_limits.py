"""The docs stay readable and their generated tables stay true: the README within one short read, the benchmarks
page within its budget and each of its sections within its own, and the plan-accuracy tables exactly what
bench/plan_accuracy_tables.py makes of the stored rows (no hand edit, no table left behind by new rows)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers import ROOT

README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
PLAN_ACCURACY = ROOT / "docs" / "plan-accuracy.md"
README_LINES = 200
BENCHMARKS_LINES = 400
# plan-accuracy.md's own words, its generated tables left out.
PLAN_ACCURACY_PROSE_LINES = 150
_BUDGET = re.compile(r"^<!-- budget: (\d+) -->$")
_GENERATED = re.compile(r"<!-- generated: (.+?) -->\n.*?<!-- end generated: \1 -->\n?", re.S)


def _lines(page: Path) -> list[str]:
    return page.read_text().splitlines()


def _sections(lines: list[str]) -> list[tuple[str, list[str]]]:
    """Each heading (outside code blocks) with its lines, from the heading to the next one."""
    starts, fenced = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            starts.append(i)
    return [(lines[a], lines[a:b]) for a, b in zip(starts, [*starts[1:], len(lines)], strict=True)]


def test_the_readme_is_a_short_read():
    assert len(_lines(README)) <= README_LINES, f"README.md has {len(_lines(README))} lines: move a topic to docs/"


def test_the_readme_states_no_dated_timings():
    """Figures with their dates live in docs/benchmarks.md; the README points there."""
    dated = [line for line in _lines(README) if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert not dated, dated


def test_the_benchmarks_page_keeps_its_budget():
    lines = _lines(BENCHMARKS)
    assert len(lines) <= BENCHMARKS_LINES, f"docs/benchmarks.md has {len(lines)} lines (at most {BENCHMARKS_LINES})"


def test_every_benchmark_section_keeps_its_own_budget():
    sections = _sections(_lines(BENCHMARKS))[1:]  # the page's own head has no budget
    assert len(sections) >= 15
    for heading, body in sections:
        if heading.startswith("## ") and not any(_BUDGET.match(line) for line in body):
            # a section that only heads its subsections
            assert all(not line.startswith("|") for line in body), f"{heading}: a table needs a budget"
            continue
        budget = next((int(m.group(1)) for line in body if (m := _BUDGET.match(line))), None)
        assert budget is not None, f"{heading}: no '<!-- budget: N -->' line"
        assert len(body) <= budget, f"{heading}: {len(body)} lines, budget {budget}"
        assert sum(line.startswith("|---") for line in body) <= 1, f"{heading}: one table per section"


def test_the_plan_accuracy_page_is_mostly_its_tables():
    prose = _GENERATED.sub("", PLAN_ACCURACY.read_text()).splitlines()
    assert len(prose) <= PLAN_ACCURACY_PROSE_LINES, f"docs/plan-accuracy.md: {len(prose)} lines besides its tables"


def _tables_module() -> ModuleType:
    path = ROOT / "bench" / "plan_accuracy_tables.py"
    spec = importlib.util.spec_from_file_location("plan_accuracy_tables", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tables() -> ModuleType:
    return _tables_module()


@pytest.fixture(scope="module")
def rendered(tables) -> dict[str, str]:
    return tables.rendered(tables.Evaluated())


def test_the_generated_tables_are_what_the_stored_rows_give(tables, rendered):
    """`python bench/plan_accuracy_tables.py` rewrites them; a stale or hand-edited block fails here."""
    checked = 0
    for name, (pages, _) in tables.BLOCKS.items():
        for page in pages:
            held = tables.current(name, page.read_text())
            assert held == rendered[name], (f"{page.relative_to(ROOT)}: block {name!r} differs from the stored rows: "
                                            "run .venv/bin/python bench/plan_accuracy_tables.py")
            checked += 1
    assert checked >= 4


def test_the_summary_has_each_repeat_of_each_host(rendered):
    """Per host and per repeat: rows, mean |error|, worst, intervals held; every stored repeat is there."""
    summary = rendered["accuracy summary"]
    repeats = {int(m) for m in re.findall(r"^\| [^|]+ \| (\d+) \(", summary, re.M)}
    assert repeats == set(range(1, 12)), repeats
    assert summary.count("**all**") == 2


def test_a_hand_edit_is_caught_and_rewritten(tables, rendered, tmp_path):
    page = tmp_path / "page.md"
    body = rendered["published rows"]
    page.write_text(f"intro\n<!-- generated: published rows -->\n{body}<!-- end generated: published rows -->\nend\n")
    edited = page.read_text().replace("| yes |", "| no |", 1)
    assert tables.current("published rows", edited) != body
    restored = tables.rewrite(edited, "published rows", body)
    assert restored == page.read_text()
    with pytest.raises(ValueError, match="no block"):
        tables.current("published rows", "no markers here")


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_names_a_file_that_exists(page):
    """Moving a topic between pages must not leave a link behind."""
    for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: link to {target} names no file"


def test_the_hosts_own_swing_is_what_moves_between_sessions_not_the_models_steady_miss(tables):
    """A configuration missed by the same +30% in every session has no swing (the model's miss); one whose error
    moves between sessions has, scaled for the noise of the other sessions' mean."""
    from dtrain.explain.calibration import Outcome, Row

    def outcome(config: str, repeat: int, error: float) -> Outcome:
        row = Row(config, f"{config}, repeat {repeat}", 1.0, "measured", repeat=repeat)
        return Outcome(row, 1.0 + error, 0.5, 2.0, {}, 0.0, "", True)

    steady = [outcome("steady", r, 0.3) for r in (1, 2, 3)]
    moving = [outcome("moving", 1, 0.1), outcome("moving", 2, -0.1)]
    swing = tables.host_swing(steady + moving)
    assert all(swing[o.row.label] == pytest.approx(0.0, abs=1e-12) for o in steady)
    assert swing["moving, repeat 1"] == pytest.approx((1.1 / 0.9 - 1) * (1 / 2) ** 0.5)
    assert swing["moving, repeat 2"] == pytest.approx((1 - 0.9 / 1.1) * (1 / 2) ** 0.5)
