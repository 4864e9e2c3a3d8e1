"""The step after a launched script's job (dtrain.launcher.scriptrun.after_job), in one process: whatever fails
while merging, summarizing or writing the report is one warning line, and the script's result stands."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.engine import scriptprof
from dtrain.launcher import scriptrun


def _reporting(summary_error: Exception | None = None) -> tuple[scriptrun.Reporting, list[str]]:
    calls: list[str] = []

    def summary(run_dir: Path, seconds: float) -> None:
        calls.append("summary")
        if summary_error is not None:
            raise summary_error

    def report(run_dir: Path) -> Path:
        calls.append("report")
        raise OSError("disk full")

    return scriptrun.Reporting(summary, report), calls


@pytest.mark.parametrize("failed", [False, True])
def test_a_failure_after_the_job_is_one_warning_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str], failed: bool) -> None:
    monkeypatch.setattr(scriptprof, "merge_rank_files", lambda run_dir, info: True)
    reporting, calls = _reporting(summary_error=KeyError("step"))
    scriptrun.after_job(tmp_path, Path("train.py"), [], 1.0, failed=failed, reporting=reporting)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert calls == (["report"] if failed else ["summary"])
    assert len(lines) == 1 and lines[0].startswith("dtrain: warning: ")
    assert ("writing report.html" if failed else "summarizing the profile") in lines[0]
    assert "the script's own result stands" in lines[0]


def test_a_merge_that_raises_is_one_warning_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    def broken(run_dir: Path, info: dict[str, object]) -> bool:
        raise ValueError("bad rank file")

    monkeypatch.setattr(scriptprof, "merge_rank_files", broken)
    reporting, calls = _reporting()
    scriptrun.after_job(tmp_path, Path("train.py"), [], 1.0, failed=False, reporting=reporting)
    err = capsys.readouterr().err
    assert calls == [] and "merging the ranks' figures" in err and "ValueError: bad rank file" in err


def test_the_exit_code_stays_the_scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script that trained (exit 0) whose summary raises: launch_script still returns 0."""
    from dtrain.launcher import agent
    from dtrain.launcher.runplan import NodeArgs

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    monkeypatch.setattr(agent, "launch", lambda command, options: None)
    monkeypatch.setattr(scriptprof, "merge_rank_files", lambda run_dir, info: True)
    monkeypatch.delenv(scriptprof.ENV, raising=False)
    reporting, _ = _reporting(summary_error=RuntimeError("broken table"))
    code = scriptrun.launch_script(script, [], 1, 0, tmp_path / "run", NodeArgs(), None, False, reporting)
    assert code == 0
