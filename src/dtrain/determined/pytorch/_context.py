"""Determined's ``pytorch.PyTorchTrialContext`` on dtrain's :class:`~dtrain.engine.context.TrialContext`.

It adds Determined's names to dtrain's context and changes nothing underneath: models, optimizers and
schedulers are dtrain's (DDP or the configured ``sync.strategy``, checkpoints, exact resume), and the
loop that calls ``train_batch`` is dtrain's. It keeps no state of its own beyond class-level defaults, so
that a plain TrialContext built elsewhere (``dtrain check``'s dry run) can be given its class.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.determined._notes import refuse
from dtrain.determined.core import DistributedContext
from dtrain.engine import schedulers
from dtrain.engine.context import TrialContext
from dtrain.engine.watchdog import STATUS, STOP
from dtrain.errors import UserError

log = logging.getLogger(__name__)

_AMP = ("dtrain scales the loss itself: set precision: 16-mixed (CUDA) or bf16-mixed in the config and drop the "
        "scaler (context.backward and step_optimizer then scale, unscale and skip overflowing steps)")
_NO_MASTER = "there is no Determined master here (no experiment or trial ids); name things by the run directory"
_PASS_THROUGH: dict[type, type] = {}


def _pass_through(wrapped: nn.Module, inner: nn.Module) -> nn.Module:
    """A wrapper (DDP) that also answers its module's attributes (``model.my_method()``), as Determined's does."""
    if wrapped is inner or "module" not in wrapped._modules:
        return wrapped
    cls = type(wrapped)
    sub = _PASS_THROUGH.get(cls)
    if sub is None:
        def __getattr__(self: nn.Module, name: str) -> Any:
            try:
                return super(sub, self).__getattr__(name)  # type: ignore[arg-type]
            except AttributeError:
                return getattr(nn.Module.__getattr__(self, "module"), name)

        sub = _PASS_THROUGH[cls] = type(cls.__name__, (cls,), {"__getattr__": __getattr__,
                                                               "__module__": cls.__module__})
    wrapped.__class__ = sub
    return wrapped


class PyTorchTrialContext(TrialContext):
    """What a Determined-style :class:`~dtrain.determined.pytorch.PyTorchTrial` is built with."""

    # Class-level defaults (see the module's docstring); set on the instance when they change.
    _epoch_len: int | None = None  # batches per epoch, once the training data is known
    _batch_from_loader = False  # Trainer API without hparams' global_batch_size: the loader's batch_size sets it
    _exp_extras: dict[str, Any] = {}  # noqa: RUF012 (never mutated: replaced) exp_conf keys dtrain does not model
    _tensorboard_logging = True
    _tb_writer: Any = None
    _stop_set_here = False

    # ------------------------------------------------------------------------------------ the experiment
    def get_per_slot_batch_size(self) -> int:
        """The per-slot batch: ``global_batch_size`` (hyperparameters) // training slots."""
        if self._batch_from_loader:
            raise UserError("context.get_per_slot_batch_size(): no global_batch_size in the hyperparameters given "
                            "to pytorch.init(hparams=...); add it there, or size the DataLoader yourself")
        return super().get_per_slot_batch_size()

    def get_global_batch_size(self) -> int:
        """The effective global batch: per-slot batch x training slots."""
        self.get_per_slot_batch_size()
        return super().get_global_batch_size()

    def get_experiment_config(self) -> dict[str, Any]:  # type: ignore[override]
        """The resolved experiment config as a plain dict (Determined's type), with the keys of
        ``pytorch.init(exp_conf=...)`` that dtrain does not model kept as given."""
        resolved = self.config.model_dump(mode="json", exclude={"code_dir"})
        # exp_conf's own sections where dtrain has none (searcher: None in a Trainer's run).
        return {**resolved, **{k: v for k, v in self._exp_extras.items() if resolved.get(k) is None}}

    def get_data_config(self) -> dict[str, Any]:
        """The config's ``data:`` section (free-form, for the trial), or {}."""
        section = getattr(self.config, "data", None) or self._exp_extras.get("data") or {}
        return dict(section)

    def get_trial_seed(self) -> int:
        return self.config.seed

    def get_initial_batch(self) -> int:
        refuse("context.get_initial_batch()", "a PyTorchCallback's on_trial_startup(first_batch_idx, ...) gets it")

    def get_experiment_id(self) -> int:
        refuse("context.get_experiment_id()", _NO_MASTER)

    def get_trial_id(self) -> int:
        refuse("context.get_trial_id()", _NO_MASTER)

    @functools.cached_property
    def distributed(self) -> DistributedContext:
        """This process's place in the job (``get_rank()``, ``get_size()``, ``get_local_rank()``, ...)."""
        return DistributedContext.from_torch_distributed()

    @functools.cached_property
    def experimental(self) -> PyTorchExperimentalContext:
        return PyTorchExperimentalContext(self)

    # --------------------------------------------------------------------------------------- stopping
    def get_stop_requested(self) -> bool:
        """Whether a stop was asked for (by the trial, or by a signal to ``dtrain run``)."""
        return STOP.requested

    def set_stop_requested(self, stop_requested: bool) -> None:
        """``True``: stop training early. Every slot stops after the same batch (the next point where the
        slots agree: within about 2 s of training), writes a checkpoint there and the run ends with exit code
        0; ``dtrain run --resume`` would continue it. ``False`` withdraws the trial's own request."""
        if not isinstance(stop_requested, bool):
            raise UserError(f"context.set_stop_requested: expected True or False, got {stop_requested!r}")
        if stop_requested and not STOP.requested:
            log.info("the trial asked to stop at batch %s: every slot stops at the next agreement point, with a "
                     "checkpoint", STATUS.batch)
        if stop_requested or self._stop_set_here:  # never withdraw a stop a signal asked for
            STOP.requested = stop_requested
        self._stop_set_here = stop_requested

    # -------------------------------------------------------------------------------------- tensorboard
    def get_enable_tensorboard_logging(self) -> bool:
        return self._tensorboard_logging

    def set_enable_tensorboard_logging(self, enable_tensorboard_logging: bool) -> None:
        """Kept for Determined's sake: dtrain always writes its metrics to ``RUN_DIR/tensorboard``."""
        self._tensorboard_logging = bool(enable_tensorboard_logging)

    def get_tensorboard_path(self) -> Path:
        """``RUN_DIR/tensorboard`` (dtrain's own event files are there too); outside a run (``dtrain
        check``), a temporary folder."""
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="dtrain-no-run-"))
        return self.run_dir / "tensorboard"

    def get_tensorboard_writer(self) -> Any:
        """A ``torch.utils.tensorboard.SummaryWriter`` on :meth:`get_tensorboard_path` (one per process)."""
        if self._tb_writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb_writer = SummaryWriter(str(self.get_tensorboard_path()), filename_suffix=f".rank{self.rank}")
        return self._tb_writer

    # ---------------------------------------------------------------------------------------- wrapping
    def wrap_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        """dtrain's wrapping (DDP by default); the wrapper also answers the model's own attributes."""
        return _pass_through(super().wrap_model(model), model)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, backward_passes_per_step: int = 1,
                       fp16_compression: bool | None = None,
                       average_aggregated_gradients: bool | None = None) -> torch.optim.Optimizer:
        """dtrain's ``wrap_optimizer``. ``backward_passes_per_step`` and ``fp16_compression`` are Horovod's
        (dtrain: ``optimizations.gradient_compression``); ``average_aggregated_gradients`` is the config's."""
        if backward_passes_per_step != 1 or fp16_compression:
            log.info("wrap_optimizer: backward_passes_per_step and fp16_compression are Horovod options; dtrain "
                     "ignores them (gradient compression: optimizations.gradient_compression)")
        configured = self.average_aggregated_gradients
        if average_aggregated_gradients is not None and average_aggregated_gradients != configured:
            raise UserError(f"wrap_optimizer(average_aggregated_gradients={average_aggregated_gradients}): dtrain "
                            f"sets it for the run; set optimizations.average_aggregated_gradients: "
                            f"{str(average_aggregated_gradients).lower()} in the config")
        return super().wrap_optimizer(optimizer)

    def wrap_lr_scheduler(self, lr_scheduler: Any, step_mode: Any = None, frequency: int = 1) -> Any:
        """Register ``lr_scheduler``, stepped by the loop per ``step_mode`` (``LRScheduler.StepMode``) every
        ``frequency`` of them; it must be built on an optimizer returned by :meth:`wrap_optimizer`."""
        optimizer = getattr(lr_scheduler, "optimizer", None)
        if optimizer is not None and not any(optimizer is o for o in self.optimizers):
            raise UserError(f"wrap_lr_scheduler: {type(lr_scheduler).__name__} is built on an optimizer that "
                            "wrap_optimizer did not return; build it on the one wrap_optimizer returned")
        return super().wrap_lr_scheduler(lr_scheduler, step_mode, frequency)

    def wrap_scaler(self, scaler: Any) -> Any:
        refuse("context.wrap_scaler()", _AMP)

    def configure_apex_amp(self, *args: Any, **kwargs: Any) -> Any:
        refuse("context.configure_apex_amp()", "apex is not supported; " + _AMP)

    def autocast_forward_pass(self, to_wrap: nn.Module) -> nn.Module:
        refuse("context.autocast_forward_pass()", "precision: bf16-mixed or 16-mixed in the config runs every "
               "wrapped model's forward under autocast")

    def wrap_reducer(self, *args: Any, **kwargs: Any) -> Any:
        refuse("context.wrap_reducer()", "dtrain reduces metrics as record-weighted means; compute other "
               "reductions in evaluate_full_dataset, or return per-batch means from evaluate_batch")

    def reset_reducers(self) -> None:
        """Nothing to reset: no custom reducers here."""

    def set_profiler(self, *args: Any, **kwargs: Any) -> None:
        """Ignored, with one line: dtrain's step profiler is on by default (``profiling:`` in the config)."""
        log.warning("context.set_profiler() is ignored: dtrain profiles every run's steps (profiling: in the config; "
                    "dtrain doctor RUN_DIR explains them); for torch.profiler, start it in a PyTorchCallback")

    # ---------------------------------------------------------------------------------------- stepping
    def backward(self, loss: torch.Tensor, gradient: torch.Tensor | None = None, retain_graph: bool = False,
                 create_graph: bool = False) -> None:  # type: ignore[override]
        """``loss.backward(...)`` through dtrain (gradient exchange, aggregation, loss scaling, profiling)."""
        if gradient is None and not retain_graph and not create_graph:
            super().backward(loss)
        else:
            super().backward(loss, gradient=gradient, retain_graph=retain_graph, create_graph=create_graph)

    def step_optimizer(self, optimizer: torch.optim.Optimizer,  # type: ignore[override]
                       clip_grads: Callable[[list[torch.Tensor]], Any] | None = None, auto_zero_grads: bool = True,
                       scaler: Any = None) -> None:
        """Step ``optimizer`` (on the last batch of an aggregation group): ``clip_grads(parameters)`` first if
        given, then the step, then ``zero_grad`` unless ``auto_zero_grads=False`` (then the trial zeroes them)."""
        if scaler is not None:
            refuse("step_optimizer(scaler=...)", _AMP)
        if auto_zero_grads:
            super().step_optimizer(optimizer, clip_grads)
            return
        if self.aggregation_frequency > 1:
            raise UserError("step_optimizer(auto_zero_grads=False) with optimizations.aggregation_frequency > 1: "
                            "the accumulated gradients must be zeroed by dtrain; keep auto_zero_grads=True")
        self.zero_grads = False
        try:
            super().step_optimizer(optimizer, clip_grads)
        finally:
            self.zero_grads = True

    # ----------------------------------------------------------------------------------- where we are
    def current_train_batch(self) -> int:
        """The index of the batch being trained (since the start of training, resumes included)."""
        if STATUS.batch is None:
            raise UserError("context.current_train_batch(): training has not started")
        return STATUS.batch

    def _epoch_length(self, what: str) -> int:
        if self._epoch_len is None:
            raise UserError(f"context.{what}(): the training data is not built yet")
        return self._epoch_len

    def current_train_epoch(self) -> int:
        return self.current_train_batch() // self._epoch_length("current_train_epoch")

    def is_epoch_start(self) -> bool:
        return self.current_train_batch() % self._epoch_length("is_epoch_start") == 0

    def is_epoch_end(self) -> bool:
        length = self._epoch_length("is_epoch_end")
        return self.current_train_batch() % length == length - 1


class PyTorchExperimentalContext:
    """``context.experimental``: the switches that mean something here."""

    def __init__(self, parent: PyTorchTrialContext) -> None:
        self._parent = parent

    def disable_dataset_reproducibility_checks(self) -> None:
        """No effect: dtrain always builds the loaders from a ``pytorch.DataLoader`` (a bare torch
        DataLoader cannot be sharded and is refused either way)."""

    def disable_auto_to_device(self) -> None:
        log.warning("context.experimental.disable_auto_to_device() is ignored: dtrain moves every batch to the "
                    "slot's device (a no-op on CPU)")

    def use_amp(self) -> None:
        refuse("context.experimental.use_amp()", _AMP)


# Determined's LRScheduler.StepMode is dtrain's enum.
StepMode = schedulers.StepMode
