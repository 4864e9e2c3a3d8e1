"""Determined's ``pytorch.DataLoader``: the arguments of torch's DataLoader, recorded; dtrain builds the loader.

As in Determined, the trial gives the *per-slot* batch size and the whole data set; dtrain shards it across
the slots (every record once per epoch) and keeps the rest of the options. Training batches always come
from dtrain's seeded permutation (the same on every slot, so N slots x B/N train as 1 slot x B) and only
full global batches are trained; validation batches come in order, every record once across the slots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch
from torch.utils.data import Dataset, IterableDataset

from dtrain.engine import data
from dtrain.errors import DataError

log = logging.getLogger(__name__)

TorchData = Union[dict[str, torch.Tensor], Sequence[torch.Tensor], torch.Tensor]  # noqa: UP007 (a public alias)

_UNSET: Any = object()  # tells an argument the user gave from its default


class DataLoader:
    """``pytorch.DataLoader(dataset, batch_size=per_slot, ...)`` with torch's arguments.

    ``batch_size`` must be the per-slot batch (``context.get_per_slot_batch_size()``). ``num_workers``,
    ``collate_fn``, ``pin_memory``, ``timeout``, ``worker_init_fn``, ``multiprocessing_context``,
    ``prefetch_factor`` and ``persistent_workers`` reach the loader as given; ``shuffle`` and ``generator``
    are dtrain's (a seeded permutation, its own generator); ``sampler`` and ``batch_sampler`` cannot be
    honoured (dtrain samples to shard) and are refused in one line, as are IterableDatasets.
    """

    def __init__(self, dataset: Dataset, batch_size: int | None = 1, shuffle: bool = _UNSET,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, generator: Any = None, *, prefetch_factor: int | None = None,
                 persistent_workers: bool = False) -> None:
        if isinstance(dataset, IterableDataset):
            raise DataError("pytorch.DataLoader: an IterableDataset cannot be sharded by dtrain; give a map-style "
                            "Dataset (with __len__ and __getitem__)")
        if sampler is not None or batch_sampler is not None:
            given = "sampler" if sampler is not None else "batch_sampler"
            raise DataError(f"pytorch.DataLoader: dtrain samples the data itself to shard it across slots; drop "
                            f"{given}= (training batches come from a seeded permutation, validation in order)")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"pytorch.DataLoader: batch_size must be the per-slot batch size (an integer >= 1), "
                            f"got {batch_size!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = False if shuffle is _UNSET else shuffle
        self._shuffle_given = shuffle is not _UNSET
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.generator = generator  # unused: dtrain's loaders draw from their own seeded generators
        options: dict[str, Any] = {"collate_fn": collate_fn, "worker_init_fn": worker_init_fn,
                                   "multiprocessing_context": multiprocessing_context,
                                   "prefetch_factor": prefetch_factor}
        # Only what differs from torch's defaults: the rest stays dtrain's (num_workers: data_loader.num_workers
        # of the config; pin_memory: on with CUDA).
        options = {k: v for k, v in options.items() if v is not None}
        if num_workers:
            options["num_workers"] = num_workers
        if pin_memory:
            options["pin_memory"] = True
        if timeout:
            options["timeout"] = timeout
        if persistent_workers:
            options["persistent_workers"] = True
        self._options = options
        data.loader_options(**{"num_workers": num_workers, **options})  # torch's own checks, as one line each

    def options(self, split: str) -> dict[str, Any]:
        """The options for dtrain's ``"train"`` or ``"eval"`` loader of this data."""
        if split == "train":
            if self._shuffle_given and not self.shuffle:
                log.warning("pytorch.DataLoader(shuffle=False) for training: dtrain trains on its seeded "
                            "permutation of the data (the same on every slot) all the same")
            return dict(self._options)  # full global batches only: see the module's docstring
        return {**self._options, "drop_last": self.drop_last}

    def __repr__(self) -> str:
        return f"pytorch.DataLoader({type(self.dataset).__name__}, batch_size={self.batch_size})"


def to_device(batch: Any, device: torch.device | str, warned_types: Any = None) -> Any:
    """``batch`` (tensors, and lists, tuples and dicts of them) moved to ``device``; other values as they are."""
    return data.to_device(batch, torch.device(device))


def data_length(batch: Any) -> int:
    """Records in ``batch``: the leading dimension of its first tensor."""
    return data.batch_size_of(batch)
