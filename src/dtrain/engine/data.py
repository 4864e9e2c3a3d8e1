"""Sharding data across slots: batch split, samplers and loaders.

Training uses torch's DistributedSampler: with the same seed and epoch every rank draws the same
permutation and takes every N-th index, so the union of the N per-slot batches at step i is exactly the
global batch a single slot would see at step i. That is what makes 1 x B and N x B/N give equal weights.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from dtrain.errors import DataError, UserError

log = logging.getLogger(__name__)


def per_slot_batch_size(global_batch_size: int, slots: int, warn: bool = True) -> int:
    """global // slots; the remainder is dropped with a warning (``warn``: the launcher gives it once, before
    any worker starts); fewer records than slots is an error."""
    if global_batch_size < slots:
        raise DataError(
            f"global_batch_size {global_batch_size} is smaller than slots_per_trial {slots}: every slot needs "
            f"at least one record; raise hyperparameters.global_batch_size to >= {slots} or use fewer slots"
        )
    per_slot = global_batch_size // slots
    if global_batch_size % slots and warn:
        log.warning(
            "global_batch_size %d is not divisible by %d slots: each slot gets %d records, so the effective "
            "global batch is %d (%d dropped per step); use a multiple of %d to avoid this",
            global_batch_size, slots, per_slot, per_slot * slots, global_batch_size % slots, slots,
        )
    return per_slot


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start mid-epoch.

    Exact resume needs "the same permutation, minus the batches already trained". torch's sampler has no
    such offset (torchdata's StatefulDataLoader does, but is an extra dependency for one integer).
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, seed: int, drop_last: bool = True) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
        self.start_index = 0
        # Called with the epoch each time an epoch's iteration starts (the context's roll call listens).
        self.on_epoch_start: Callable[[int], None] | None = None
        # The DataLoader draws its workers' base seed from a generator each time an iterator is made. With
        # the default (global) RNG, making an iterator mid-epoch on resume would shift every later random
        # draw (dropout...). A private generator, reseeded per epoch, keeps the global stream untouched.
        self.loader_generator = torch.Generator().manual_seed(seed)

    def set_start(self, epoch: int, samples_to_skip: int) -> None:
        self.set_epoch(epoch)
        self.start_index = samples_to_skip
        self.loader_generator.manual_seed(self.seed + 1_000_003 * (epoch + 1))

    def __iter__(self) -> Iterator[int]:
        if self.on_epoch_start is not None:
            self.on_epoch_start(self.epoch)
        indices = list(super().__iter__())
        return iter(indices[self.start_index :])

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class ShardSampler(Sampler[int]):
    """Every record exactly once across ranks, in order, shards possibly uneven.

    DistributedSampler pads the last shard with repeated records, which would count them twice in
    validation metrics.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int) -> None:
        self.indices = list(range(rank, len(dataset), num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _check_size(dataset: Any, what: str, minimum: int, hint: str) -> int:
    try:
        size = len(dataset)
    except TypeError:
        raise DataError(
            f"the {what} data must be a map-style Dataset with __len__, got {type(dataset).__name__}"
        ) from None
    if size < minimum:
        raise DataError(f"the {what} data has {size} records, fewer than {minimum}: {hint}")
    return size


# DataLoader options dtrain owns: the sampler decides what each slot sees, and its own generator keeps
# the global RNG stream untouched (see ResumableDistributedSampler).
_OWNED = ("sampler", "batch_sampler", "shuffle", "generator", "batch_size")


def loader_options(num_workers: int = 0, pin_memory: bool = False, collate_fn: Callable[..., Any] | None = None,
                   persistent_workers: bool = False, prefetch_factor: int | None = None,
                   **extra: Any) -> dict[str, Any]:
    """The DataLoader keyword arguments a user may set, checked with one-line errors (torch's own are
    multi-line ValueErrors raised only when the loader is built)."""
    owned = sorted(set(extra) & set(_OWNED))
    if owned:
        raise DataError(f"ctx.loader sets {', '.join(owned)} itself (it shards the data across slots); drop "
                        f"{'it' if len(owned) == 1 else 'them'} and use split='train' or split='eval'")
    if num_workers < 0:
        raise DataError(f"num_workers must be >= 0, got {num_workers}")
    if num_workers == 0 and (persistent_workers or prefetch_factor is not None):
        given = "persistent_workers" if persistent_workers else "prefetch_factor"
        raise DataError(f"{given} needs background loader processes: set num_workers >= 1")
    options: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory, **extra}
    if collate_fn is not None:
        options["collate_fn"] = collate_fn
    if persistent_workers:
        options["persistent_workers"] = True
    if prefetch_factor is not None:
        options["prefetch_factor"] = prefetch_factor
    return options


def train_loader(
    dataset: Dataset, per_slot: int, rank: int, world_size: int, seed: int, num_workers: int = 0,
    pin_memory: bool = False, drop_last: bool = True, **options: Any,
) -> tuple[DataLoader, ResumableDistributedSampler]:
    """Shuffled and sharded; every slot gets the same number of batches (or DDP would wait forever).

    ``drop_last=True`` (dtrain's default): full global batches only, so N slots x B/N see exactly the
    batches 1 slot x B sees. ``drop_last=False`` is torch's ``DistributedSampler`` behaviour: the epoch's
    tail becomes one last, smaller batch on every slot, padded with records from the epoch's start so the
    slots stay in step; that batch differs from what one slot would see. ``pin_memory`` (for CUDA) lets
    host-to-device copies run asynchronously; ``options`` go to the DataLoader (see :func:`loader_options`).
    """
    global_batch = per_slot * world_size
    minimum = global_batch if drop_last else 1
    _check_size(dataset, "training", minimum,
                f"one global batch needs {global_batch}; lower the batch size" if drop_last else "add records")
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed,  # type: ignore[arg-type]
                                          drop_last=drop_last)
    loader = DataLoader(dataset, batch_size=per_slot, sampler=sampler, drop_last=drop_last,
                        generator=sampler.loader_generator,
                        **loader_options(num_workers=num_workers, pin_memory=pin_memory, **options))
    return loader, sampler


def eval_loader(dataset: Dataset, per_slot: int, rank: int, world_size: int, num_workers: int = 0,
                pin_memory: bool = False, drop_last: bool = False, **options: Any) -> DataLoader:
    """Every record exactly once across slots, in order; shards and last batches may be uneven, so weight
    metrics by batch size (``ctx.reduce(metrics, weight=len(batch))``)."""
    _check_size(dataset, "validation", world_size, f"every one of the {world_size} slots needs at least one")
    sampler = ShardSampler(dataset, num_replicas=world_size, rank=rank)  # type: ignore[arg-type]
    # Own generator: validation must not consume the training RNG stream (see ResumableDistributedSampler).
    return DataLoader(dataset, batch_size=per_slot, sampler=sampler, drop_last=drop_last,
                      generator=torch.Generator().manual_seed(rank),
                      **loader_options(num_workers=num_workers, pin_memory=pin_memory, **options))


def first_batch(loader: DataLoader) -> Any:
    """The batch ``loader`` would yield first, read and collated in this process as its workers would
    (``__getitems__`` where the data set has it): no worker process is started, nothing fetched ahead.

    For synthetic data, which needs one batch: an iterator of a loader with ``num_workers`` would start
    its workers, and workers started and stopped beside the training slots' threads are a hazard of
    their own (a fork while another thread holds CPython 3.11's thread-state lock leaves the child
    hung: cpython#112275; in this repository a later loader worker hung that way in 3 of 80 runs)."""
    if loader.batch_sampler is None:
        raise DataError("synthetic data needs a loader with a batch size")
    indices = next(iter(loader.batch_sampler))  # the sampler's epoch start is announced as usual
    dataset = loader.dataset
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(indices) if getitems else [dataset[i] for i in indices]  # type: ignore[index]
    return loader.collate_fn(samples)


def batches_per_epoch(dataset: Sized, global_batch: int) -> int:
    return len(dataset) // global_batch


def batch_size_of(batch: Any) -> int:
    """Number of records in a batch (first tensor's leading dimension)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_size_of(next(iter(batch.values())))
    raise DataError(f"cannot tell the batch size of a {type(batch).__name__}; return tensors, tuples or dicts")


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class DeviceFeeder:
    """Batches of an iterator, on the device. On CUDA the next batch is copied on a side stream while
    the current one computes (pinned memory makes the copy asynchronous), so the step never waits for a
    host-to-device copy it could have overlapped; the compute stream waits for the copy, not the host.
    On CPU there is nothing to overlap: batches are handed over as they come.
    """

    _END = object()

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._on_cpu = device.type == "cpu"
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._iterator: Iterator[Any] | None = None
        self._next: Any = self._END

    def start(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator
        if self._stream is not None:
            self._next = self._copy_next()

    def fetcher(self) -> Callable[[], Any]:
        """The cheapest callable returning the next batch: on CPU the iterator's own ``__next__``, so a
        step spends no frame of ours on handing a batch over; on an accelerator :meth:`__next__`."""
        if self._on_cpu and self._iterator is not None:
            return self._iterator.__next__
        return self.__next__

    def __next__(self) -> Any:
        if self._iterator is None:
            raise StopIteration
        if self._stream is None:
            # A CPU loader's batches are already where the model is: handed over untouched (walking the
            # batch to call a no-op ``.to`` on each tensor costs microseconds every step).
            batch = next(self._iterator)
            return batch if self._on_cpu else to_device(batch, self.device)
        batch = self._next
        if batch is self._END:
            raise StopIteration
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)
        _record_stream(batch, current)  # the copy's memory now belongs to the compute stream
        self._next = self._copy_next()
        return batch

    def _copy_next(self) -> Any:
        try:
            host = next(self._iterator)  # type: ignore[arg-type]
        except StopIteration:
            return self._END
        with torch.cuda.stream(self._stream):
            return to_device(host, self.device)


def _record_stream(batch: Any, stream: Any) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            _record_stream(item, stream)
    elif isinstance(batch, dict):
        for item in batch.values():
            _record_stream(item, stream)


_warned_shuffle = False  # the deprecated ``shuffle=`` of ctx.loader warns once per process


def loader_split(split: Any, shuffle: bool | None) -> str:
    """``ctx.loader``'s ``split`` ("train" or "eval"), from it or from the deprecated ``shuffle``."""
    global _warned_shuffle
    if isinstance(split, bool):  # ctx.loader(data, 32, False): the old positional shuffle
        shuffle, split = split, None
    if shuffle is not None:
        if split is not None:
            raise UserError("ctx.loader: give split= or the deprecated shuffle=, not both")
        if not _warned_shuffle:
            _warned_shuffle = True
            warnings.warn("ctx.loader(shuffle=...) is deprecated: use split='train' (shuffle=True) or "
                          "split='eval' (shuffle=False, every record once)", FutureWarning, stacklevel=3)
        return "train" if shuffle else "eval"
    if split is None:
        return "train"
    if split not in ("train", "eval"):
        raise UserError(f"ctx.loader: split must be 'train' or 'eval', got {split!r}")
    return split
