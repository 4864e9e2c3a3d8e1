"""Continuing a run: which checkpoint a ``--resume`` starts from, refusing to redo a finished run, and
the one line (with the command that continues it) for a run stopped by a signal."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from dtrain.config.schema import ExperimentConfig
from dtrain.engine import checkpoint
from dtrain.engine.stopping import read_stopped
from dtrain.errors import CheckpointError
from dtrain.launcher.supervise import Stopped

if TYPE_CHECKING:
    from dtrain.launcher.runplan import RunPlan

log = logging.getLogger(__name__)


class AlreadyFinished(Exception):
    """``--resume`` of a run that already reached the config's ``max_length``: nothing to train."""


def resume_checkpoint(resume: Path, config: ExperimentConfig) -> Path | None:
    """The checkpoint to resume from; None for a run that stopped before its first checkpoint (it starts
    over in place, so that "resume with --resume RUN_DIR" is the one advice for every stopped run)."""
    if not resume.is_dir():
        raise CheckpointError(f"--resume {resume}: no such run directory; pass a directory made by 'dtrain run'")
    root = resume / config.checkpoint_storage.path
    found = checkpoint.latest(root)
    if found is None:
        if (resume / "config.yaml").is_file():
            log.warning("--resume %s: the run stopped before its first checkpoint; it starts over from batch 0",
                        resume)
            return None
        raise CheckpointError(f"--resume {resume}: no checkpoint found under {root} (no 'latest') and no run "
                              "there; pass a directory made by 'dtrain run'")
    meta = checkpoint.check(found)  # data-only load of every file: a bad checkpoint fails here, not in N workers
    check_not_finished(resume, config, int(meta.get("batches", 0)))
    return found


def check_not_finished(run_dir: Path, config: ExperimentConfig, done: int) -> None:
    """Refuse to resume a run that already reached ``max_length`` (it would rewrite its results for nothing)."""
    total = config.max_length.batches
    if total is None:  # epochs: one epoch's batches are known from the finished run's summary, if any
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
            total = round(config.max_length.epochs * summary["batches"] / summary["epochs"])  # type: ignore[operator]
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            return  # the worker checks again once it knows the data (Trainer.fit)
    if done >= total:
        unit = f"batches: {config.max_length.batches}" if config.max_length.batches else \
            f"epochs: {config.max_length.epochs}"
        raise AlreadyFinished(f"run {run_dir} already finished: it trained {done} batches (max_length {{{unit}}}); "
                              "nothing to do. To train it longer, raise max_length, e.g. --set "
                              f"max_length.batches={2 * done}")


def resume_advice(plan: RunPlan, config_path: Path) -> str:
    """The one way to continue a run that stopped, whether or not it reached a checkpoint."""
    advice = f"resume with: dtrain run {config_path} --resume {plan.run_dir}"
    if checkpoint.latest(plan.run_dir / plan.config.checkpoint_storage.path) is None:
        advice += " (no checkpoint was written yet: it starts over from batch 0)"
    return advice


def stop_line(plan: RunPlan, stop: Stopped, config_path: Path, started: float) -> str | None:
    """The one line for a run stopped by a signal, with the command that continues it; None when the run
    finished anyway (the signal came during its last moments, ``started``: ``time.time()`` at launch)."""
    resume = resume_advice(plan, config_path)
    batch = read_stopped(plan.run_dir / "logs")
    summary = plan.run_dir / "summary.json"
    if batch is None and summary.is_file() and summary.stat().st_mtime >= started:
        return None
    if batch is not None:
        return f"dtrain: stopped at batch {batch} by {stop.signal_name}; {resume}"
    found = checkpoint.latest(plan.run_dir / plan.config.checkpoint_storage.path)
    if found is not None:
        return (f"dtrain: stopped by {stop.signal_name} before the ranks agreed on a batch to stop at (killed after "
                f"resources.preemption_grace_seconds or a second signal); the last checkpoint is at batch "
                f"{found.name}; {resume}")
    return f"dtrain: stopped by {stop.signal_name} before the first checkpoint; {resume}"
