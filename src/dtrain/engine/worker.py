"""What each slot runs: ``python -m dtrain.engine.worker --run-dir DIR``, started by torch's elastic agent."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from dtrain.config.schema import load_config
from dtrain.dist import DistEnv, read_env
from dtrain.engine import checkpoint, watchdog
from dtrain.engine.failures import ECHO_EXIT_DELAY_SECONDS, is_secondary, write_report
from dtrain.engine.nonfinite import NonFiniteError
from dtrain.engine.trainer import run_trial
from dtrain.errors import UserError

log = logging.getLogger("dtrain")


def setup_logging(run_dir: Path, env: DistEnv, quiet: bool) -> None:
    """Every rank logs to ``logs/rank<r>.log``; the chief also to the console (warnings only if quiet)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {env.rank}] %(levelname)s %(name)s: %(message)s")
    file_handler = logging.FileHandler(logs / f"rank{env.rank}.log")
    file_handler.setFormatter(fmt)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(f"[rank {env.rank}] %(levelname)s: %(message)s"))
    console.setLevel(logging.INFO if env.is_chief and not quiet else logging.WARNING)
    if not env.is_chief:
        console.setLevel(logging.ERROR)  # the launcher reports a failing rank's root cause itself
    root = logging.getLogger()
    root.handlers[:] = [file_handler, console]
    root.setLevel(logging.INFO)


def resume_point(run_dir: Path, ckpt_path: str, resume_from: Path | None, env: DistEnv) -> Path | None:
    """This run's newest checkpoint, else ``--resume-from``.

    A run directory holds no checkpoint when its job starts, except the one it resumes in place (the
    launcher refuses any other): a newer one was written by this very job, before an elastic restart or a
    membership change. A node that joined the job later, whose agent has not restarted, resumes from it as
    well. Every worker of the job has stopped before any worker of the next world starts, so it is complete.
    """
    own = checkpoint.latest(run_dir / ckpt_path)
    if own is None or (resume_from is not None and own.resolve() == resume_from.resolve()):
        return resume_from
    if env.is_chief:
        log.warning("continuing this run from its own checkpoint %s (restart %d, world size %d)", own,
                    env.restart_count, env.world_size)
    return own


def _log_to_file_only() -> None:
    """A failing rank's details go to its log file; the console gets the launcher's one-line summary."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.CRITICAL)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dtrain.engine.worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--resume-from", type=Path)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    watchdog.die_with_launcher()  # first: a launcher killed during our imports must not leave us behind
    env = read_env()
    setup_logging(args.run_dir, env, args.quiet)
    logs = args.run_dir / "logs"
    # Under torchrun or srun (no dtrain launcher) the SIGTERM handling stays theirs.
    watchdog.start(logs, env.rank, handle_signals=watchdog.LAUNCHER_PID_ENV in os.environ,
                   master=(env.master_addr, env.master_port) if env.launched else None)
    try:
        config = load_config(args.run_dir / "config.yaml")
        resume = resume_point(args.run_dir, config.checkpoint_storage.path, args.resume_from, env)
        summary = run_trial(config, args.run_dir, resume, args.quiet)
        # For the launcher (an elastic job's agent): stopped at an agreed batch, or finished.
        stopped = summary.get("stopped_at") if isinstance(summary, dict) else None
        watchdog.STATUS.enter("stopped" if stopped is not None else "finished", stopped)
        watchdog.publish_now()
    except UserError as exc:
        # Bad input found inside a worker (e.g. the trial's data): one line from the launcher, exit 2.
        _log_to_file_only()
        log.error("%s", exc)
        watchdog.publish_now()
        write_report(logs, env.rank, exc, user_error=True, exit_code=exc.exit_code)
        sys.exit(exc.exit_code)
    except Exception as exc:
        _log_to_file_only()
        log.exception("worker failed")  # the full text (Gloo's included) goes to this rank's log only
        watchdog.publish_now()
        # A non-finite loss stops every rank; the report names the rank where it appeared, not a code line.
        nonfinite = isinstance(exc, NonFiniteError)
        write_report(logs, env.rank, exc, user_error=False, exit_code=1, where="" if nonfinite else None,
                     blame=exc.rank if nonfinite else None)
        if is_secondary(str(exc)):
            time.sleep(ECHO_EXIT_DELAY_SECONDS)
        sys.exit(1)


def _exit_without_teardown(code: int = 0) -> None:
    """Leave once everything is written, skipping the interpreter's teardown.

    Seen here under heavy load: a worker that had finished and written its summary was killed by SIGABRT
    while the interpreter tore down (native communication threads racing the exit), and a failed worker
    took 4-5 s to tear down while its peers waited on its open connections for the news. Nothing is left
    to do at that point, so flush what Python buffers and exit directly.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as exc:  # a failure, already reported: its peers learn it when our sockets close
        _exit_without_teardown(exc.code if isinstance(exc.code, int) else 1)
    _exit_without_teardown()
