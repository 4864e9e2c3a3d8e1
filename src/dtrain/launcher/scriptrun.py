"""``dtrain launch SCRIPT``: a user's own script on N slots, profiled into a run directory.

The launcher's part of a script's run: where its profile goes (:func:`run_dir_for`; the workers find it in
``DTRAIN_PROFILE``), the job itself (:func:`launch_script`, torch's elastic agent as for ``dtrain run``), and the
step after it (:func:`after_job`): the ranks' files merged where rank 0 could not, the time table, the doctor's
verdict and ``report.html``. Nothing in that step may fail a run that trained: an error there is one warning line,
and the exit code stays the script's. What the records mean is ``explain``'s (above this room), so the summary and
the report come in as callables.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dtrain.errors import UserError

if TYPE_CHECKING:
    from dtrain.launcher.runplan import NodeArgs

PROG = "dtrain"
log = logging.getLogger("dtrain")


@dataclass(frozen=True)
class Reporting:
    """How a profiled run is told (``explain``'s functions, handed down by the command line): ``summary``
    prints the time table and the doctor's verdict and writes report.html; ``report`` writes report.html and
    returns its path."""

    summary: Callable[[Path, float], None]
    report: Callable[[Path], Path]


def run_dir_for(given: Path | None, script: Path) -> Path:
    """The run directory a launched script is profiled into (its workers read ``DTRAIN_PROFILE``); a new one
    under runs/ unless given, printed. An earlier launch's rank files there are removed: they are not this one's."""
    from dtrain.engine import scriptprof

    run_dir = given if given is not None else Path("runs") / f"{script.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {str(run_dir)!r} is a file; pass a directory")
    (run_dir / scriptprof.RANKS).mkdir(parents=True, exist_ok=True)
    for stale in (run_dir / scriptprof.RANKS).glob("rank-*.json"):
        stale.unlink()
    if given is None:
        print(f"{PROG}: profiling {script} into {run_dir}", file=sys.stderr)
    os.environ[scriptprof.ENV] = str(run_dir.resolve())
    return run_dir


def after_job(run_dir: Path, script: Path, script_args: list[str], seconds: float, failed: bool,
              reporting: Reporting) -> None:
    """After the job: the ranks' files merged where rank 0 could not (a crash; a rank the agent stopped leaves
    none), then the summary and report.html. Never raises: whatever fails here is one warning line, and the
    script's own result stands."""
    from dtrain.engine import scriptprof

    os.environ.pop(scriptprof.ENV, None)
    info = {"launcher": "dtrain launch", "command": [str(script), *script_args], "cwd": os.getcwd(),
            "script": str(script.resolve())}
    stage = "merging the ranks' figures"
    try:
        if not scriptprof.merge_rank_files(run_dir, info):
            return
        if failed:  # what the ranks measured before the failure
            stage = "writing report.html"
            print(f"{PROG}: partial profile (the job failed) in {run_dir}; report {reporting.report(run_dir)}",
                  file=sys.stderr)
        else:
            stage = "summarizing the profile"
            reporting.summary(run_dir, seconds)  # the time table, the doctor's verdict and report.html
    except Exception as exc:  # dtrain's own step after the job must never turn a trained run into a failed one
        log.debug("after the job", exc_info=True)
        print(f"{PROG}: warning: {stage} in {run_dir} failed ({type(exc).__name__}: {exc}); the script's own result "
              "stands", file=sys.stderr)


def launch_script(script: Path, script_args: list[str], slots: int, max_restarts: int, given_run_dir: Path | None,
                  nodes_args: NodeArgs, node_rank: int | None, debug: bool, reporting: Reporting) -> int:
    """Run ``script`` on ``slots`` (the whole job's, split over the nodes), profiled; the exit code: 0, the
    script's own where it chose one (``sys.exit(2)`` stays 2), else 1."""
    from dtrain.launcher.runplan import script_nodes

    if not script.is_file():
        raise UserError(f"script {str(script)!r} does not exist; pass the path of a Python training script")
    if not 0 <= max_restarts <= 100:  # the same bound as the config's max_restarts
        raise UserError(f"--max-restarts must be from 0 to 100, got {max_restarts}")
    # Several machines: checked, then met, before any worker starts (--slots is the job's total).
    nodes, per_node = script_nodes(nodes_args, script, script_args, slots, max_restarts)
    from dtrain.launcher import forkstart
    from dtrain.launcher.agent import LaunchOptions, launch

    run_dir = run_dir_for(given_run_dir, script)
    started = time.perf_counter()
    # Through dtrain.engine.script_main: the script's exceptions are reported, its workers die with this process.
    failure = launch(forkstart.script_worker([str(script), *script_args]),
                     LaunchOptions(slots=per_node, max_restarts=max_restarts, debug=debug, nodes=nodes))
    if node_rank in (None, 0):  # the node that ran rank 0 (the others sent their figures)
        after_job(run_dir, script, script_args, time.perf_counter() - started, failed=failure is not None,
                  reporting=reporting)
    if failure is not None:
        print(f"{PROG}: error: {failure.headline()}", file=sys.stderr)
        return failure.exit_code if failure.exit_code > 0 else 1
    return 0
