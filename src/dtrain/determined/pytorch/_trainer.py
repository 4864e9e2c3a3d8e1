"""Determined's Trainer API: ``with pytorch.init(...) as context: Trainer(MyTrial(context), context).fit(...)``.

It runs dtrain's Trial loop in this process, on the slots of whatever started it: ``dtrain launch --slots N
script.py``, ``torchrun --nproc-per-node N script.py``, or a plain ``python script.py`` (one slot). The run
writes what a ``dtrain run`` writes (metrics.jsonl, TensorBoard, checkpoints, summary.json, profile.json,
config.yaml) into its run directory: ``pytorch.init(run_dir=...)``, else ``$DTRAIN_RUN_DIR``, else a new
``./runs/<name>-<time>``. ``fit(latest_checkpoint=PATH)`` continues from a checkpoint folder (or a folder
holding ``latest``); a run directory you named that already holds checkpoints is continued from its latest
one (as a Determined cluster continues a paused trial).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dtrain import dist as ddist
from dtrain.config.schema import config_from_dict, dump_config
from dtrain.determined.core import DistributedContext
from dtrain.determined.pytorch._config import agreed_run_dir, config_for_init
from dtrain.determined.pytorch._context import PyTorchTrialContext
from dtrain.determined.pytorch._trial import PyTorchTrial
from dtrain.determined.pytorch._units import Batch, Epoch, TrainUnit
from dtrain.engine import checkpoint
from dtrain.engine.hparams import HparamReads
from dtrain.engine.seeding import seed_everything
from dtrain.engine.trainer import fit_trial
from dtrain.engine.watchdog import STOP
from dtrain.errors import UserError

log = logging.getLogger(__name__)


@contextlib.contextmanager
def init(*, hparams: Mapping[str, Any] | None = None, exp_conf: Mapping[str, Any] | None = None,
         distributed: DistributedContext | None = None, aggregation_frequency: int = 1,
         enable_tensorboard_logging: bool = True, run_dir: str | Path | None = None) -> Iterator[PyTorchTrialContext]:
    """Join this job's slots and yield the context to build a trial with and hand to :class:`Trainer`.

    ``hparams`` are the trial's hyperparameters (``global_batch_size`` among them sets the per-slot batch;
    without it the training loader's ``batch_size`` is the per-slot batch). ``exp_conf`` is an experiment
    config (Determined's keys that dtrain models are used, the rest ignored with one line). ``distributed``
    may describe this process (``core.DistributedContext.from_torch_distributed()``); dtrain reads the
    launcher's environment itself and refuses a description that disagrees. ``run_dir`` is dtrain's own.
    The process group is left when the block ends (on a failure only in a world of one: peers must learn
    of the failure from this rank's report first).
    """
    env = ddist.read_env()
    if distributed is not None and (distributed.get_rank(), distributed.get_size()) != (env.rank, env.world_size):
        raise UserError(f"pytorch.init(distributed=...) says rank {distributed.get_rank()} of "
                        f"{distributed.get_size()}, the launcher says rank {env.rank} of {env.world_size}; drop "
                        "distributed= (dtrain reads the launcher's environment)")
    raw, extras, ignored, from_loader = config_for_init(hparams, exp_conf, env.world_size, aggregation_frequency)
    if ignored and env.is_chief:
        log.info("pytorch.init: exp_conf keys with no meaning here, ignored: %s", ", ".join(ignored))
    config = config_from_dict(raw, source="pytorch.init(exp_conf=...)")
    seed_everything(config.seed)  # identical initial weights on every slot, as in dtrain run
    context = PyTorchTrialContext(config)
    context._exp_extras = extras
    context._batch_from_loader = from_loader
    context._tensorboard_logging = bool(enable_tensorboard_logging)
    context.hparam_reads = HparamReads(dict(hparams or {}))  # the trial's own, without a stand-in batch size
    context.run_dir, context._run_dir_named = agreed_run_dir(run_dir, config.name, context.rank,  # type: ignore[attr-defined]
                                                             context.world_size)
    try:
        yield context
    except BaseException:
        if context.world_size == 1:
            context.close()
        raise
    context.close()


class Trainer:
    """``Trainer(trial, context).fit(max_length=pytorch.Epoch(1), ...)``: dtrain's Trial loop in this process."""

    def __init__(self, trial: PyTorchTrial, context: PyTorchTrialContext) -> None:
        if not isinstance(trial, PyTorchTrial):
            raise UserError(f"pytorch.Trainer: expected a dtrain.determined.pytorch.PyTorchTrial, got "
                            f"{type(trial).__name__}")
        if not isinstance(context, PyTorchTrialContext) or context.run_dir is None:
            raise UserError("pytorch.Trainer: give it the context of `with pytorch.init(...) as context:`")
        self._trial, self._context = trial, context

    def configure_profiler(self, *args: Any, **kwargs: Any) -> None:
        """Deprecated in Determined; dtrain's step profiler is on by default (``profiling:`` of exp_conf)."""
        log.warning("Trainer.configure_profiler() is ignored: dtrain profiles every run (profiling: in exp_conf)")

    def fit(self, checkpoint_period: TrainUnit | None = None, validation_period: TrainUnit | None = None,
            max_length: TrainUnit | None = None, reporting_period: TrainUnit = Batch(100),  # noqa: B008
            checkpoint_policy: str = "best", latest_checkpoint: str | Path | None = None,
            step_zero_validation: bool = False, test_mode: bool = False,
            profiling_enabled: bool = False) -> dict[str, Any]:
        """Train to ``max_length`` (``Batch(n)`` or ``Epoch(n)``), validating every ``validation_period``
        and checkpointing every ``checkpoint_period``; always validates and checkpoints at the end.

        ``checkpoint_policy``: ``"all"`` also checkpoints at each validation when no ``checkpoint_period``
        is given; ``"best"`` needs a searcher and, as in Determined's local mode, acts as ``"all"``;
        ``"none"`` adds nothing. ``test_mode`` trains one batch (and validates on the whole set).
        ``profiling_enabled`` is ignored: dtrain's profiler follows ``profiling.enabled``. Returns the
        run's summary (also in ``RUN_DIR/summary.json``).
        """
        trial, context = self._trial, self._context
        if test_mode:
            max_length = Batch(1)
        if not isinstance(max_length, (Batch, Epoch)):
            raise UserError(f"Trainer.fit: max_length must be pytorch.Batch(N) or pytorch.Epoch(N), got {max_length!r}")
        if checkpoint_policy not in ("best", "all", "none"):
            raise UserError(f"Trainer.fit: checkpoint_policy must be 'best', 'all' or 'none', "
                            f"got {checkpoint_policy!r}")
        if profiling_enabled:
            log.info("Trainer.fit(profiling_enabled=True): dtrain's step profiler follows profiling.enabled (on "
                     "by default); system metrics are not collected")
        trial._built.clear()  # a new fit builds its loaders anew, as Determined does
        train_set = trial.build_training_data()  # sets the per-slot batch when hparams had no global_batch_size
        trial.build_validation_data()
        per_epoch = context._epoch_len or 1
        periods = {"max_length": max_length.to_length("max_length")}
        if validation_period is not None:
            periods["min_validation_period"] = validation_period.to_length("validation_period")
        if checkpoint_period is not None:
            periods["min_checkpoint_period"] = checkpoint_period.to_length("checkpoint_period")
        elif checkpoint_policy != "none" and validation_period is not None:
            periods["min_checkpoint_period"] = periods["min_validation_period"]  # a checkpoint at each validation
        report = reporting_period.to_length("reporting_period")
        raw = context.config.model_dump(mode="json")
        raw.update(periods, entrypoint=f"{type(trial).__module__}:{type(trial).__name__}",
                   scheduling_unit=report.get("batches") or report["epochs"] * per_epoch,
                   hyperparameters={**raw["hyperparameters"],
                                    "global_batch_size": context.per_slot_batch_size * context.strategy.dp_world})
        config = config_from_dict(raw, source="pytorch.Trainer.fit")
        context.config = config
        run_dir: Path = context.run_dir  # type: ignore[assignment]
        resume = self._resume_point(latest_checkpoint, run_dir / config.checkpoint_storage.path)
        if context.is_chief:
            dump_config(config, run_dir / "config.yaml")
            log.info("pytorch.Trainer: run directory %s (%d records, %d batches per epoch)", run_dir,
                     len(train_set), per_epoch)  # type: ignore[arg-type]
        stop_before = STOP.requested
        try:
            return fit_trial(context, trial, config, run_dir, resume, quiet=False, validate_first=step_zero_validation)
        finally:
            if context._stop_set_here and not stop_before:  # the trial's own request ends with its fit
                STOP.requested = context._stop_set_here = False

    def _resume_point(self, latest_checkpoint: str | Path | None, checkpoints: Path) -> Path | None:
        """Where to continue from: ``latest_checkpoint``; else, in a run directory the user named, its newest
        checkpoint; else nowhere."""
        if latest_checkpoint is not None:
            path = Path(latest_checkpoint)
            if not path.exists():
                raise UserError(f"Trainer.fit(latest_checkpoint={str(latest_checkpoint)!r}): no such checkpoint; give "
                                "a checkpoint folder (RUN_DIR/checkpoints/<batches>) or a folder holding 'latest'")
            return path
        found = checkpoint.newest_complete(checkpoints)
        if found is not None and getattr(self._context, "_run_dir_named", False):
            if self._context.is_chief:
                log.warning("pytorch.Trainer: continuing from %s, the newest checkpoint of this run directory", found)
            return found
        return None
