"""Loop callbacks: the one extension point of the step loop, for users and for dtrain's own benches.

A Trial returns its callbacks from ``build_callbacks()`` as ``{name: LoopCallback}``. :class:`LoopCallback`
has Determined's ``PyTorchCallback`` hooks, with the same names and arguments where dtrain has the same
thing to give, plus dtrain's own per-step hook (:meth:`LoopCallback.on_step_end`). Determined's
``on_training_workload_end`` and ``on_checkpoint_upload_end`` map to :meth:`LoopCallback.on_training_report` and
:meth:`LoopCallback.on_checkpoint_write_end`; its deprecated validation-step and validation-epoch hooks have no
counterpart. The trainer talks to the callbacks through :class:`Callbacks`, which resolves once which hooks
each one overrides: a hook nobody overrides costs nothing per step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dtrain.errors import UserError

log = logging.getLogger(__name__)


class LoopCallback:
    """Subclass this, override the hooks you need, and return it from your Trial's ``build_callbacks()``.

    Every rank runs its own copy of each callback, and every hook below runs on every rank (Determined
    runs some on the chief only: check ``context.rank`` to act on one rank). Order within a run::

        on_checkpoint_load_start, load_state_dict         (resuming only)
        on_trial_startup, on_training_start
        per batch: [on_training_epoch_start] on_step_end [on_training_epoch_end]
                   then that batch's validation and checkpoint hooks, if it has any
        on_trial_shutdown

    ``on_training_report`` comes when a report is written, a step or more after its batch, and always before
    the validation, checkpoint or end that follows it.

    A hook that raises fails the run like an exception in ``train_batch`` does. Hooks get plain values
    (ints, strings, dicts of floats) that the loop has on the host anyway. On a parameter server's
    server ranks, which train nothing, only the checkpoint hooks run.

    A stateful callback overrides :meth:`state_dict` and :meth:`load_state_dict`: the state is saved in
    every checkpoint and restored on resume, so it continues where the checkpoint left it. It must be data
    (tensors, numbers, strings, bytes, None, and lists, tuples and dicts of them), as everything in a
    checkpoint is.
    """

    def on_trial_startup(self, first_batch_idx: int, checkpoint_dir: str | None) -> None:
        """Before training: the index of the first batch to train (0, or the batches a resumed checkpoint
        holds) and the checkpoint folder resumed from, or None."""

    def on_training_start(self) -> None:
        """After any checkpoint is loaded, just before the first step."""

    def on_training_epoch_start(self, epoch_idx: int) -> None:
        """Before the first batch of epoch ``epoch_idx`` (not on resuming in the middle of it)."""

    def on_step_end(self, batch_idx: int) -> None:
        """dtrain's own: after every step, with the ``batch_idx`` that ``train_batch`` got; before that
        batch's report, validation and checkpoint, so a checkpoint holds the state after its last step.
        The loop calls it only when some callback overrides it (or ``on_training_epoch_end``)."""

    def on_training_epoch_end(self, epoch_idx: int) -> None:
        """After the last batch of epoch ``epoch_idx`` (right after its ``on_step_end``)."""

    def on_training_report(self, batches: int, metrics: dict[str, float]) -> None:
        """A training report (every ``scheduling_unit`` batches) as it is written: its batch count and its
        means, across the slots (``average_training_metrics``) or this rank's own. Reports are written a
        step or more after their batch (their all-reduce runs meanwhile), so this comes later than the
        batch's ``on_step_end``. With ``average_training_metrics`` off, ranks other than the chief read their
        own sums from the device for it, once per report. Determined's ``on_training_workload_end(avg_metrics,
        batch_metrics)`` maps here: dtrain keeps no per-batch metrics (they are summed on the device)."""

    def on_validation_start(self) -> None:
        """Before a validation pass (only where the Trial has validation data)."""

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        """After a validation pass, with its metrics reduced over every slot (the same on every rank)."""

    def on_checkpoint_save_start(self, checkpoint: dict[str, Any]) -> None:
        """Before a checkpoint is saved: ``checkpoint`` holds the values saved beside the weights
        (``batches``, and the callbacks' states under ``callbacks``); keys added here on rank 0 are saved
        too (data only) and come back in :meth:`on_checkpoint_load_start`."""

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:
        """After a checkpoint is committed (complete on disk, ``latest`` names it), with its folder.
        Determined's ``on_checkpoint_upload_end`` maps here too: dtrain uploads nothing."""

    def on_checkpoint_load_start(self, checkpoint: dict[str, Any]) -> None:
        """On resume, with what :meth:`on_checkpoint_save_start` saw; the weights are already restored,
        the callbacks' states are loaded next."""

    def on_trial_shutdown(self) -> None:
        """The loop is over: ``max_length`` reached (after the last validation and checkpoint) or every rank
        agreed to stop (after its checkpoint). Not after a failure."""

    def state_dict(self) -> dict[str, Any]:
        """This callback's state, saved in every checkpoint (data only)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, on resume."""


HOOKS = ("on_trial_startup", "on_training_start", "on_training_epoch_start", "on_step_end", "on_training_epoch_end",
         "on_training_report", "on_validation_start", "on_validation_end", "on_checkpoint_save_start",
         "on_checkpoint_write_end", "on_checkpoint_load_start", "on_trial_shutdown")


def _overrides(callback: LoopCallback, hook: str) -> bool:
    method = getattr(callback, hook)
    return getattr(method, "__func__", None) is not getattr(LoopCallback, hook)


def _checked(callbacks: Any) -> dict[str, LoopCallback]:
    if not isinstance(callbacks, Mapping):
        raise UserError(f"build_callbacks() returned a {type(callbacks).__name__}; return a dict of "
                        "name -> dtrain.LoopCallback (an empty one for none)")
    for name, callback in callbacks.items():
        if not isinstance(name, str) or not isinstance(callback, LoopCallback):
            raise UserError(f"build_callbacks(): entry {name!r} is a {type(callback).__name__}; each must be a "
                            "dtrain.LoopCallback, keyed by a name (its state's key in checkpoints)")
    return dict(callbacks)


# Exactly what a checkpoint's data-only load (torch.load(weights_only=True)) gives back, on every torch
# dtrain supports; subclasses (numpy scalars, defaultdict, named tuples) are pickled as code and refused.
_LEAVES = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device)
_LISTS = (list, tuple, torch.Size)
_DICTS = (dict, OrderedDict)


def _data_only(value: Any, where: str) -> None:
    """Refuse, naming where, a state a checkpoint could not load back; before anything is written."""
    kind = type(value)
    if kind in _LEAVES or isinstance(value, torch.Tensor):
        return
    if kind in _LISTS:
        for i, item in enumerate(value):
            _data_only(item, f"{where}[{i}]")
        return
    if kind in _DICTS:
        for key, item in value.items():
            _data_only(key, f"{where} (a key)")
            _data_only(item, f"{where}[{key!r}]")
        return
    raise UserError(f"{where} is a {kind.__name__}: checkpoints keep data only (tensors, numbers, strings, bytes, "
                    "None, and lists, tuples and dicts of them); convert it (e.g. .tolist(), torch.as_tensor)")


class Callbacks:
    """A Trial's callbacks as the trainer calls them.

    Each hook is resolved here, once, to the bound methods that override it; the others are never called.
    The step loop checks one attribute, :attr:`step_end`, None unless a callback overrides a per-step hook.
    """

    def __init__(self, callbacks: Any, batches_per_epoch: int) -> None:
        self.named = _checked(callbacks)
        self._on: dict[str, list[Callable[..., None]]] = {
            hook: [getattr(cb, hook) for cb in self.named.values() if _overrides(cb, hook)] for hook in HOOKS}
        self.wants_reports = bool(self._on["on_training_report"])
        self.step_end = self._per_step(batches_per_epoch)

    def _fire(self, hook: str, *args: Any) -> None:
        for method in self._on[hook]:
            method(*args)

    def _per_step(self, batches_per_epoch: int) -> Callable[[int], None] | None:
        """What the loop calls after each step with the batches trained so far, or None when nothing would run."""
        steps, epoch_ends = self._on["on_step_end"], self._on["on_training_epoch_end"]
        if not steps and not epoch_ends:
            return None

        def step_end(batches: int) -> None:
            for method in steps:
                method(batches - 1)
            if epoch_ends and batches % batches_per_epoch == 0:
                for method in epoch_ends:
                    method(batches // batches_per_epoch - 1)

        return step_end

    def on_trial_startup(self, first_batch_idx: int, checkpoint_dir: str | None) -> None:
        self._fire("on_trial_startup", first_batch_idx, checkpoint_dir)

    def on_training_start(self) -> None:
        self._fire("on_training_start")

    def on_training_epoch_start(self, epoch_idx: int) -> None:
        self._fire("on_training_epoch_start", epoch_idx)

    def on_training_report(self, batches: int, metrics: dict[str, float]) -> None:
        self._fire("on_training_report", batches, metrics)

    def on_validation_start(self) -> None:
        self._fire("on_validation_start")

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        self._fire("on_validation_end", metrics)

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:
        self._fire("on_checkpoint_write_end", checkpoint_dir)

    def on_trial_shutdown(self) -> None:
        self._fire("on_trial_shutdown")

    def save_into(self, extra: dict[str, Any], rank_extra: dict[str, Any]) -> None:
        """Before a checkpoint: every callback's state into ``extra`` (the chief's, which every rank reads
        back) and ``rank_extra`` (this rank's own), then ``on_checkpoint_save_start``. Nothing is added
        without callbacks: their checkpoints stay as they were."""
        if not self.named:
            return
        states = {}
        for name, callback in self.named.items():
            state = callback.state_dict()
            _data_only(state, f"callback {name!r}: state_dict()")
            states[name] = state
        extra["callbacks"] = rank_extra["callbacks"] = states
        self._fire("on_checkpoint_save_start", extra)

    def load_from(self, extra: dict[str, Any], rank_extra: dict[str, Any] | None) -> None:
        """On resume: ``on_checkpoint_load_start``, then each callback's state, this rank's own where the
        job's layout is unchanged, else the chief's (the per-rank files belong to another slot count)."""
        self._fire("on_checkpoint_load_start", extra)
        saved = (rank_extra or {}).get("callbacks", extra.get("callbacks"))
        if not isinstance(saved, dict):
            return  # a checkpoint written without callbacks: they start fresh
        for name, callback in self.named.items():
            if name in saved:
                callback.load_state_dict(saved[name])
            else:
                log.warning("callback %r has no state in the checkpoint (it holds %s): it starts fresh",
                            name, ", ".join(map(repr, saved)) or "none")
