"""What ``dtrain launch`` runs on each slot: ``python -m dtrain.engine.script_main SCRIPT ARGS...``.

The user's script runs as ``python SCRIPT ARGS...`` would run it (``__main__``, ``sys.argv``, its folder
first on ``sys.path``), with what dtrain's own workers have around them: the worker dies with its
launcher (:func:`dtrain.engine.watchdog.die_with_launcher`), publishes where it is (the context marks its
phases), and an exception leaves an error report, so that the launcher's one line names the real
exception and the line of the script that raised it rather than "exited with code 1".

Where ``DTRAIN_PROFILE`` names a run directory (``dtrain launch`` sets it; ``python -m dtrain.profile`` too), the
script is profiled (:mod:`dtrain.engine.scriptprof`): its hooks go in before the script runs, and a crash still
leaves this rank's figures.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path
from types import TracebackType

from dtrain.engine import scriptprof, watchdog
from dtrain.engine.failures import SECONDARY, write_report


def _env() -> tuple[int, tuple[str, int] | None]:
    """This slot's rank and the job's master address."""
    from dtrain.dist import read_env  # the one reader of the launcher's rank variables

    env = read_env()
    return env.rank, (env.master_addr, env.master_port) if env.launched else None


def _in_script(exc: BaseException, script: Path) -> str:
    """The innermost frame of the user's own script (where *their* code raised), else the innermost one."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if Path(f.filename).resolve() == script]
    frame = (own or frames)[-1] if frames else None
    return f"{frame.filename}:{frame.lineno} in {frame.name}" if frame is not None else ""


def _print(exc: BaseException, script: Path) -> None:
    """The traceback as ``python SCRIPT`` would print it (from the script's first frame on); nothing for
    a peer's echo ("Connection reset by peer"): the launcher names the rank that failed first."""
    if any(p in str(exc) for p in SECONDARY):
        return
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve() != script:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


def main(argv: list[str], launcher: str = "dtrain launch") -> None:
    # A forked worker dumps its stack on SIGTERM until its main runs (forkchild.become_worker: a child stuck
    # at its start says where). The script owns its signals from here, as in an exec'd worker: the agent's
    # SIGTERM to the survivors of a failed rank prints nothing.
    faulthandler.unregister(signal.SIGTERM)
    watchdog.die_with_launcher()
    if not argv:
        raise SystemExit("usage: python -m dtrain.engine.script_main SCRIPT [ARGS...]")
    script = Path(argv[0]).resolve()
    profile_dir = os.environ.get(scriptprof.ENV)
    if profile_dir:
        scriptprof.start(Path(profile_dir), list(argv), launcher)
    reports = watchdog.status_dir_from_env()
    rank, master = _env()
    # The script owns its signals; only the status thread runs.
    watchdog.start(reports, rank, handle_signals=False, master=master)
    sys.argv = list(argv)
    sys.path.insert(0, str(script.parent))
    code: object = None
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:  # (the exception and its frames are gone after this block: see below)
        code = exc.code
    except BaseException as exc:
        _print(exc, script)
        scriptprof.finish("crash")  # this rank's figures so far, for the launcher to merge
        if reports is not None:
            watchdog.publish_now()
            write_report(reports, rank, exc, user_error=False, exit_code=1, where=_in_script(exc, script))
        sys.stderr.flush()
        os._exit(1)
    scriptprof.release_before_teardown()
    if code is not None:
        raise SystemExit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
