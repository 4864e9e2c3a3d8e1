"""A run from the launcher's side: validate everything, lay out the run directory, launch, summarise.

Every check that can fail on bad input happens here, before any worker starts, so a mistake costs one
line and exit code 2 rather than N tracebacks.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from dtrain import checkpoint, data
from dtrain.config import ExperimentConfig, dump_config, load_config
from dtrain.dist import resolve_backend
from dtrain.errors import CheckpointError, UserError
from dtrain.launch import Failure, LaunchOptions, launch
from dtrain.trial import load_trial_class

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPlan:
    config: ExperimentConfig
    run_dir: Path
    resume_from: Path | None


def prepare(config_path: Path, overrides: list[str], run_dir: Path | None, resume: Path | None) -> RunPlan:
    """Validate the config and inputs, create the run directory and write the resolved config."""
    logging.basicConfig(level=logging.WARNING, format="dtrain: warning: %(message)s")
    config = load_config(config_path, overrides)
    load_trial_class(config.entrypoint, config.code_dir)
    slots = config.resources.slots_per_trial
    data.per_slot_batch_size(config.global_batch_size, slots)
    _check_backend(config.backend, slots)
    resume_from = _resume_checkpoint(resume, config) if resume is not None else None
    if run_dir is None:
        run_dir = resume if resume is not None else Path("runs") / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    _prepare_run_dir(run_dir, continuing=resume is not None and run_dir.resolve() == resume.resolve())
    _write_config(config, run_dir)
    return RunPlan(config, run_dir, resume_from)


def _check_backend(requested: str, slots: int) -> None:
    backend = resolve_backend(requested)
    if backend == "nccl" and slots > torch.cuda.device_count():
        raise UserError(f"{slots} slots with NCCL need {slots} GPUs but {torch.cuda.device_count()} are visible; "
                        f"use --slots {torch.cuda.device_count()} or backend: gloo")


def _resume_checkpoint(resume: Path, config: ExperimentConfig) -> Path:
    if not resume.is_dir():
        raise CheckpointError(f"--resume {resume}: no such run directory; pass a directory made by 'dtrain run'")
    root = resume / config.checkpoint_storage.path
    found = checkpoint.latest(root)
    if found is None:
        raise CheckpointError(f"--resume {resume}: no checkpoint found under {root} (no 'latest'); "
                              "the run never reached a checkpoint, start it again without --resume")
    checkpoint.verify(found)
    return found


def _prepare_run_dir(run_dir: Path, continuing: bool) -> None:
    if not continuing and (run_dir / "config.yaml").exists():
        raise UserError(f"run directory {run_dir} already holds a run; continue it with --resume {run_dir} "
                        "or choose another --run-dir")
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write run directory {run_dir}: {exc.strerror or exc}; "
                        "choose a writable place with --run-dir") from None


def _write_config(config: ExperimentConfig, run_dir: Path) -> None:
    path = run_dir / "config.yaml"
    if path.exists():
        old = yaml.safe_load(path.read_text())
        if old != config.model_dump(mode="json"):
            shutil.copy2(path, run_dir / f"config.before-resume-{time.strftime('%Y%m%d-%H%M%S')}.yaml")
    dump_config(config, path)


def execute(plan: RunPlan, quiet: bool, debug: bool) -> Failure | None:
    command = ["-u", "-m", "dtrain.worker", "--run-dir", str(plan.run_dir)]
    if plan.resume_from is not None:
        command += ["--resume-from", str(plan.resume_from)]
    if quiet:
        command.append("--quiet")
    options = LaunchOptions(slots=plan.config.resources.slots_per_trial, max_restarts=plan.config.max_restarts,
                            run_dir=plan.run_dir, debug=debug)
    return launch(command, options)


def print_summary(run_dir: Path, seconds: float) -> None:
    path = run_dir / "summary.json"
    if not path.exists():
        return
    s = json.loads(path.read_text())
    val = "  ".join(f"{k} {v:.4f}" for k, v in s.get("validation", {}).items())
    print(f"dtrain: done in {seconds:.1f}s: {s['batches']} batches on {s['slots']} slot(s), "
          f"{s['samples_per_second']:,.0f} samples/s" + (f"; validation: {val}" if val else ""))
    breakdown = s.get("step_breakdown_seconds", {})
    if breakdown.get("step"):
        parts = "  ".join(f"{k} {1000 * v:.2f}ms ({100 * v / breakdown['step']:.0f}%)"
                          for k, v in breakdown.items() if k != "step")
        print(f"dtrain: step {1000 * breakdown['step']:.2f}ms (rank 0): {parts}")
