"""Determined's ``pytorch.PyTorchCallback`` on dtrain's loop callbacks (:class:`dtrain.LoopCallback`).

The hooks keep Determined's names, arguments and ranks: ``on_checkpoint_write_end`` (and the deprecated
``on_checkpoint_end``) run on the chief only, ``on_checkpoint_upload_end`` on every rank after them (dtrain
uploads nothing: it gets the checkpoint's folder where Determined gave a storage id), and
``on_training_workload_end(avg_metrics, batch_metrics)`` runs at each training report with the report's
means (``batch_metrics`` is empty: dtrain sums metrics on the device and keeps no per-batch values). Every
other hook runs on every rank, as in Determined. ``state_dict``/``load_state_dict`` travel in every
checkpoint (data only: tensors, numbers, strings, lists and dicts of them).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dtrain.engine.callbacks import LoopCallback
from dtrain.errors import UserError

# Determined's validation-epoch hooks, deprecated there, with their per-batch outputs: nothing to map them to.
_GONE = ("on_validation_epoch_start", "on_validation_epoch_end")


def _is_chief() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class PyTorchCallback(LoopCallback):
    """Subclass it, override Determined's hooks, and return it from ``build_callbacks()`` by name."""

    def on_trial_startup(self, first_batch_idx: int, checkpoint_uuid: str | None) -> None:
        """Before training: the first batch to train and the checkpoint (its folder) resumed from, or None."""

    def on_checkpoint_end(self, checkpoint_dir: str) -> None:
        """Deprecated in Determined: as :meth:`on_checkpoint_write_end`, just before it (chief only)."""

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:
        """After a checkpoint is complete in ``checkpoint_dir``; on the chief only, as in Determined."""

    def on_checkpoint_upload_end(self, uuid: str) -> None:
        """After every checkpoint, on every rank, with the checkpoint's folder (nothing is uploaded here)."""

    def on_training_workload_end(self, avg_metrics: dict[str, Any], batch_metrics: Any) -> None:
        """At each training report (every ``scheduling_unit`` batches) with its means over the slots;
        ``batch_metrics`` is an empty list (no per-batch values are kept)."""

    def on_validation_epoch_start(self) -> None:
        """Deprecated in Determined and not called here: override :meth:`on_validation_start`."""

    def on_validation_epoch_end(self, outputs: list[Any]) -> None:
        """Deprecated in Determined and not called here: override :meth:`on_validation_end`."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _GONE:
            if _overrides(cls, name):
                raise UserError(f"{cls.__name__}.{name}: Determined deprecated this hook and dtrain keeps no "
                                f"per-batch validation outputs; move it to on_validation_start / on_validation_end")
        own = cls.__dict__.get("on_checkpoint_write_end")
        if own is not None and own is not _checkpoint_written:
            cls._user_write_end = own  # type: ignore[attr-defined]
        if any(_overrides(cls, n) for n in ("on_checkpoint_end", "on_checkpoint_upload_end")) or \
                getattr(cls, "_user_write_end", None) is not None:
            cls.on_checkpoint_write_end = _checkpoint_written  # type: ignore[method-assign]
        if _overrides(cls, "on_training_workload_end") and "on_training_report" not in cls.__dict__:
            cls.on_training_report = _workload_end  # type: ignore[method-assign]


def _overrides(cls: type, name: str) -> bool:
    return getattr(cls, name) is not getattr(PyTorchCallback, name)


def _checkpoint_written(self: PyTorchCallback, checkpoint_dir: str) -> None:
    """dtrain's ``on_checkpoint_write_end`` (every rank) as Determined calls its three hooks."""
    cls = type(self)
    if _is_chief():
        if _overrides(cls, "on_checkpoint_end"):
            self.on_checkpoint_end(checkpoint_dir)
        user = getattr(cls, "_user_write_end", None)
        if user is not None:
            user(self, checkpoint_dir)
    self.on_checkpoint_upload_end(checkpoint_dir)


def _workload_end(self: PyTorchCallback, batches: int, metrics: dict[str, float]) -> None:
    self.on_training_workload_end(avg_metrics=metrics, batch_metrics=[])
