"""Determined's ``pytorch.PyTorchTrial`` as a dtrain Trial (``dtrain run`` accepts it as an entrypoint).

Determined's methods map onto dtrain's: ``build_training_data_loader`` / ``build_validation_data_loader``
return a :class:`~dtrain.determined.pytorch.DataLoader` (per-slot ``batch_size``: checked), whose data set
and options dtrain's sharded loaders take; ``train_batch`` may return a dict or a bare loss;
``evaluate_batch(batch)`` or ``evaluate_batch(batch, batch_idx)`` (the signature is read once, when the
class is defined), or ``evaluate_full_dataset(data_loader)``: exactly one of the two, as in Determined.
"""

from __future__ import annotations

import enum
import functools
import inspect
from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from dtrain.determined.pytorch._callback import PyTorchCallback
from dtrain.determined.pytorch._context import PyTorchTrialContext
from dtrain.determined.pytorch._data import DataLoader, TorchData
from dtrain.engine import data
from dtrain.engine.context import TrialContext
from dtrain.engine.trial import PyTorchTrial as DtrainTrial
from dtrain.errors import DataError, UserError


class Reducer(enum.Enum):
    """Determined's evaluation reducers; dtrain reduces validation metrics as record-weighted means
    (``AVG``), the others are refused in one line."""

    AVG = 1
    SUM = 2
    MAX = 3
    MIN = 4


def _takes_batch_idx(method: Callable[..., Any]) -> bool:
    """Whether ``evaluate_batch`` accepts ``batch_idx`` (by name, a second positional or ``*args``)."""
    params = list(inspect.signature(method).parameters.values())[1:]  # after self
    if any(p.name == "batch_idx" or p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 2


def _with_batch_idx(method: Callable[..., Any]) -> Callable[..., Any]:
    """``evaluate_batch(batch)`` callable as ``evaluate_batch(batch, batch_idx)``, as dtrain's loop calls it."""

    @functools.wraps(method)
    def evaluate_batch(self: Any, batch: Any, batch_idx: int | None = None) -> Any:
        return method(self, batch)

    evaluate_batch._one_argument = True  # type: ignore[attr-defined]
    return evaluate_batch


class PyTorchTrial(DtrainTrial):
    """Subclass it as in Determined: build and wrap models, optimizers and schedulers in ``__init__``,
    return ``pytorch.DataLoader``s, train in ``train_batch``, validate in ``evaluate_batch`` (or
    ``evaluate_full_dataset``). dtrain runs it (``dtrain run`` with ``entrypoint: model_def:MyTrial``,
    or ``pytorch.Trainer``)."""

    context_class: ClassVar[type[TrialContext]] = PyTorchTrialContext
    trial_context_class: ClassVar[type[TrialContext]] = PyTorchTrialContext  # Determined's name for it
    context: PyTorchTrialContext

    def __new__(cls, context: TrialContext, *args: Any, **kwargs: Any) -> PyTorchTrial:
        # Determined's trials set self.context themselves and rarely call super().__init__: it is set here,
        # before their __init__ runs.
        self = super().__new__(cls)
        self.context = context  # type: ignore[assignment]
        self._built: dict[str, DataLoader] = {}
        return self

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("evaluate_batch")
        if own is not None and not getattr(own, "_one_argument", False) and not _takes_batch_idx(own):
            cls.evaluate_batch = _with_batch_idx(own)  # type: ignore[method-assign]

    # ------------------------------------------------------------------------------ Determined's methods
    @abstractmethod
    def train_batch(self, batch: TorchData, epoch_idx: int, batch_idx: int) -> Any:  # type: ignore[override]
        """One step on this slot's batch (``context.backward``, ``context.step_optimizer``); returns a dict
        of scalar metrics, or the loss alone (reported as ``loss``)."""

    @abstractmethod
    def build_training_data_loader(self) -> DataLoader:
        """``pytorch.DataLoader(dataset, batch_size=context.get_per_slot_batch_size(), ...)``."""

    @abstractmethod
    def build_validation_data_loader(self) -> DataLoader:
        """``pytorch.DataLoader(dataset, batch_size=context.get_per_slot_batch_size(), ...)``."""

    def evaluation_reducer(self) -> Reducer | dict[str, Reducer]:
        """Only ``Reducer.AVG`` here (record-weighted means, exact across slots)."""
        return Reducer.AVG

    def build_callbacks(self) -> dict[str, PyTorchCallback]:  # type: ignore[override]
        """``{name: PyTorchCallback}``; the name keys the callback's state in checkpoints."""
        return {}

    # ---------------------------------------------------------------------------- dtrain's side of it
    def build_training_data(self) -> Dataset:
        loader = self._loader("train", self.build_training_data_loader)
        global_batch = loader.batch_size * self.context.strategy.dp_world
        self.context._epoch_len = data.batches_per_epoch(loader.dataset, global_batch)  # type: ignore[arg-type]
        return loader.dataset

    def build_validation_data(self) -> Dataset | None:
        overrides = [name for name in ("evaluate_batch", "evaluate_full_dataset")
                     if getattr(type(self), name) is not getattr(DtrainTrial, name)]
        if len(overrides) != 1:
            raise UserError(f"{type(self).__name__}: define exactly one of evaluate_batch() or "
                            f"evaluate_full_dataset(){' (it defines both)' if overrides else ''}")
        reducers = self.evaluation_reducer()
        values = reducers.values() if isinstance(reducers, Mapping) else [reducers]
        if any(r is not Reducer.AVG for r in values):
            raise UserError(f"{type(self).__name__}.evaluation_reducer(): dtrain reduces validation metrics as "
                            "record-weighted means (Reducer.AVG) only; compute sums, maxima or minima in "
                            "evaluate_full_dataset")
        return self._loader("eval", self.build_validation_data_loader).dataset

    def loader_options(self, split: str) -> dict[str, Any]:
        built = self._built.get(split)
        return built.options(split) if built is not None else {}

    def _loader(self, split: str, build: Callable[[], Any]) -> DataLoader:
        """The trial's loader for ``split``, built once per run and checked against the per-slot batch."""
        if split in self._built:
            return self._built[split]
        loader = build()
        what = "build_training_data_loader" if split == "train" else "build_validation_data_loader"
        if isinstance(loader, TorchDataLoader):
            raise DataError(f"{what}() returned a torch DataLoader: dtrain cannot shard it; return "
                            "pytorch.DataLoader(dataset, batch_size=per_slot, ...) with the same arguments")
        if not isinstance(loader, DataLoader):
            raise DataError(f"{what}() returned a {type(loader).__name__}; return pytorch.DataLoader(dataset, "
                            "batch_size=context.get_per_slot_batch_size(), ...)")
        context = self.context
        if context._batch_from_loader:  # pytorch.Trainer without global_batch_size: the loader's sets it
            context.per_slot_batch_size, context._batch_from_loader = loader.batch_size, False
        per_slot = context.get_per_slot_batch_size()
        if loader.batch_size != per_slot:
            raise DataError(f"{what}(): batch_size is {loader.batch_size} but the per-slot batch size is {per_slot} "
                            f"(global_batch_size {context.get_global_batch_size()} over {context.strategy.dp_world} "
                            "slot(s)); pass batch_size=self.context.get_per_slot_batch_size()")
        self._built[split] = loader
        return loader
