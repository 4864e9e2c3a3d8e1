"""Continuing a run: which config and checkpoint a ``--resume`` starts from, what it changes, refusing to
redo a finished run, and the one line (with the command that continues it) for a run that stopped."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.config import safeyaml
from dtrain.config.schema import ExperimentConfig
from dtrain.engine import checkpoint
from dtrain.engine.stopping import read_stopped
from dtrain.errors import CheckpointError, UserError
from dtrain.launcher.supervise import Stopped

if TYPE_CHECKING:
    from dtrain.launcher.runplan import RunPlan

log = logging.getLogger(__name__)
RUN_CONFIG = "config.yaml"  # the resolved config a run directory holds (overrides applied)
# Changes a resume names first: they decide how much is trained and how the global batch is split.
_FIRST = ("max_length", "resources.slots_per_trial", "hyperparameters.global_batch_size")
_MAX_NAMED = 6


class AlreadyFinished(Exception):
    """``--resume`` of a run that already reached the config's ``max_length``: nothing to train."""


def config_path(config: Path | None, resume: Path | None) -> Path:
    """The experiment YAML a ``dtrain run`` reads: the one given, else the resumed run's own resolved config
    (so that ``dtrain run --resume RUN_DIR`` continues the run exactly as it was started)."""
    if config is not None:
        return config
    if resume is None:
        raise UserError("dtrain run needs CONFIG (an experiment YAML), or --resume RUN_DIR to continue a run")
    found = resume / RUN_CONFIG
    if not found.is_file():
        what = "no such directory" if not resume.is_dir() else f"no {RUN_CONFIG} there"
        raise UserError(f"--resume {resume}: {what}, so it is not a run directory made by 'dtrain run'; pass one, "
                        f"or the experiment YAML too: dtrain run CONFIG --resume {resume}")
    return found


def changes(run_dir: Path, config: ExperimentConfig) -> list[str]:
    """``key old -> new`` for each setting in which ``config`` differs from the run's own resolved config,
    the length and the slot count first; empty when it does not differ (or the run has no config)."""
    try:
        before = safeyaml.read_file(run_dir / RUN_CONFIG)
    except (OSError, UserError):
        return []
    if not isinstance(before, dict):
        return []
    old, new = _flat(before), _flat(config.model_dump(mode="json"))
    differing = [key for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]
    differing.sort(key=lambda key: (not key.startswith(_FIRST), _rank(key)))
    return [f"{key} {_show(old.get(key))} -> {_show(new.get(key))}" for key in differing]


def _rank(key: str) -> int:
    return next((i for i, first in enumerate(_FIRST) if key.startswith(first)), len(_FIRST))


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as dotted keys; ``max_length`` stays whole (``{batches: 8}`` vs ``{epochs: 2}``)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name != "max_length":
            flat.update(_flat(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _show(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items() if v is not None) + "}"
    return safeyaml.plain(str(value), 60)


def announce_changes(run_dir: Path, config: ExperimentConfig) -> None:
    """Say, before anything trains, what a resume changes against the run's own settings."""
    found = changes(run_dir, config)
    if not found:
        return
    named = "; ".join(found[:_MAX_NAMED]) + (f"; and {len(found) - _MAX_NAMED} more" if len(found) > _MAX_NAMED
                                             else "")
    print(f"dtrain: resuming {run_dir} with settings that differ from the run's own ({run_dir / RUN_CONFIG}): "
          f"{named}. 'dtrain run --resume {run_dir}' alone keeps the run's settings", file=sys.stderr, flush=True)


def resume_checkpoint(resume: Path, config: ExperimentConfig) -> Path | None:
    """The checkpoint to resume from; None for a run that stopped before its first checkpoint (it starts
    over in place, so that "resume with --resume RUN_DIR" is the one advice for every stopped run)."""
    if not resume.is_dir():
        raise CheckpointError(f"--resume {resume}: no such run directory; pass a directory made by 'dtrain run'")
    root = resume / config.checkpoint_storage.path
    found = checkpoint.latest(root)
    if found is None:
        if (resume / RUN_CONFIG).is_file():
            log.warning("--resume %s: the run stopped before its first checkpoint; it starts over from batch 0",
                        resume)
            return None
        raise CheckpointError(f"--resume {resume}: no checkpoint found under {root} (no 'latest') and no run "
                              "there; pass a directory made by 'dtrain run'")
    meta = checkpoint.check(found)  # data-only load of every file: a bad checkpoint fails here, not in N workers
    check_not_finished(resume, config, int(meta.get("batches", 0)), checkpoint.read_extra(found))
    return found


def check_not_finished(run_dir: Path, config: ExperimentConfig, done: int,
                       extra: dict[str, Any] | None = None) -> None:
    """Refuse to resume a run that already reached ``max_length`` (it would rewrite its results for nothing).
    A length in epochs is turned into batches with the epoch's batches the checkpoint recorded (``extra``),
    else the finished run's summary."""
    total = config.max_length.batches
    if total is None:
        per_epoch = _batches_per_epoch(run_dir, extra or {})
        if per_epoch is None:
            return  # the worker checks again once it knows the data (Trainer.fit)
        total = round(config.max_length.epochs * per_epoch)  # type: ignore[operator]
    if done >= total:
        # The advice is in the unit the config counts in: the other unit beside it would be refused.
        if config.max_length.batches:
            unit, longer = f"batches: {config.max_length.batches}", f"max_length.batches={2 * done}"
        else:
            epochs = config.max_length.epochs or 0
            unit, longer = f"epochs: {epochs}", f"max_length.epochs={2 * epochs}"
        raise AlreadyFinished(f"run {run_dir} already finished: it trained {done} batches (max_length {{{unit}}}); "
                              f"nothing to do. To train it longer, raise max_length, e.g. --set {longer}")


def _batches_per_epoch(run_dir: Path, extra: dict[str, Any]) -> float | None:
    recorded = extra.get("batches_per_epoch")
    if isinstance(recorded, int) and recorded > 0:
        return recorded
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        return float(summary["batches"]) / float(summary["epochs"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def resume_command(plan: RunPlan) -> str:
    """The command that continues this run with its own settings (on every node, for several)."""
    command = f"dtrain run --resume {plan.run_dir}"
    if plan.nodes is not None:
        command += " (on every node, with the same --nnodes/--master/--rdzv-* options)"
    return command


def resume_advice(plan: RunPlan) -> str:
    """What to do about a run that stopped, by what it left: continue from its checkpoint, or (none written)
    start it over in the same directory."""
    if checkpoint.latest(plan.run_dir / plan.config.checkpoint_storage.path) is None:
        return (f"no checkpoint was written, so there is nothing to resume: fix the cause, then start again with "
                f"{resume_command(plan)} (the run's settings, from batch 0) or a new 'dtrain run CONFIG --run-dir "
                f"{plan.run_dir}' (the directory is free for it)")
    if _finished_training(plan):  # a failure after the last step (its end-of-run figures): --resume would refuse
        return ("its training had finished (its last checkpoint is at max_length), so there is nothing to resume; "
                "what failed came after it, at the end of the run")
    return f"resume with: {resume_command(plan)}"


def _finished_training(plan: RunPlan) -> bool:
    """Whether the run's latest checkpoint is at ``max_length`` (named by its batch count)."""
    found = checkpoint.latest(plan.run_dir / plan.config.checkpoint_storage.path)
    if found is None or not found.name.isdigit():
        return False
    try:
        check_not_finished(plan.run_dir, plan.config, int(found.name), checkpoint.read_extra(found))
    except AlreadyFinished:
        return True
    except CheckpointError:  # a damaged checkpoint: --resume says so itself
        return False
    return False


def stop_line(plan: RunPlan, stop: Stopped, started: float) -> str | None:
    """The one line for a run stopped by a signal, with the command that continues it; None when the run
    finished anyway (the signal came during its last moments, ``started``: ``time.time()`` at launch)."""
    resume = f"resume with: {resume_command(plan)}"
    batch = read_stopped(plan.run_dir / "logs", since=stop.signalled_at)
    if stop.left:
        at = f" at batch {batch}" if batch is not None and stop.clean else ""
        how = ("" if stop.clean else ", while it met the other nodes: none of its workers had started"
               if stop.no_workers else ", its workers stopped before they could agree on a batch")
        return (f"dtrain: this node left the elastic job{at} ({stop.signal_name}{how}); the other nodes go on "
                f"without it while --nnodes's minimum remain (else they stop there too); rejoin with the same "
                f"command, or {resume}")
    summary = plan.run_dir / "summary.json"
    # On one node of several, the summary may be the job's, finished elsewhere: this node was still stopped.
    if batch is None and plan.nodes is None and summary.is_file() and summary.stat().st_mtime >= started:
        return None
    if batch is not None:
        return f"dtrain: stopped at batch {batch} by {stop.signal_name}; {resume}"
    found = checkpoint.latest(plan.run_dir / plan.config.checkpoint_storage.path)
    if found is not None:
        return (f"dtrain: stopped by {stop.signal_name} before the ranks agreed on a batch to stop at (killed after "
                f"resources.preemption_grace_seconds or a second signal); the last checkpoint is at batch "
                f"{found.name}; {resume}")
    return f"dtrain: stopped by {stop.signal_name} before the first checkpoint; {resume} (it starts over from batch 0)"
