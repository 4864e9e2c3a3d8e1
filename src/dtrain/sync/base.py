"""The one interface the trainer talks to for keeping replicas in sync.

A strategy owns wrapping the model and optimizer and every collective they need, in the spirit of
Lightning Fabric's strategies, minus the connector: the trainer never calls torch.distributed itself for
gradients or weights. One optimizer step is::

    exchange_gradients(opt)   # collective strategies: make gradients global (timed as communication)
    step(opt)                 # the update (timed as optimizer)
    after_step(opt)           # e.g. local SGD's periodic weight averaging (timed as communication)

What a strategy can and cannot do is declared as class attributes (its *capabilities*); config
validation, ``dtrain compare``, the trainer and the doctor read them from the registry
(:mod:`dtrain.sync.registry`) instead of knowing strategies by name. Optional behaviour is a small
protocol (:class:`Rebucketable`, :class:`Serving`).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from dtrain import dist as ddist
from dtrain.profiling.comm import NULL_RECORDER, CommRecorder
from dtrain.profiling.record import ALL_REDUCE

if TYPE_CHECKING:
    from dtrain.sync.options import StrategyConfig


class SyncStrategy(ABC):
    """How gradients (or weights) are exchanged between slots."""

    name: ClassVar[str] = "base"
    # ------------------------------------------------------------------------------ capabilities
    # Gradient compressions this strategy can honour (optimizations.gradient_compression).
    compressions: ClassVar[frozenset[str]] = frozenset({"none"})
    # optimizations.tensor_fusion_threshold can be re-tuned mid-run (needs the Rebucketable protocol).
    tunable_fusion: ClassVar[bool] = False
    # Replicas can differ between synchronizations (local SGD): each rank's own weights are checkpointed.
    replicas_may_differ: ClassVar[bool] = False
    # Optimizer state is not the same on every rank (sharded, or local): it is checkpointed per rank,
    # so a checkpoint only resumes on the same number of slots.
    per_rank_optimizer_state: ClassVar[bool] = False
    # Whether exchange_gradients/after_step communicate (timed as exposed communication) or do nothing
    # (DDP and FSDP communicate inside backward).
    exchanges_in_step: ClassVar[bool] = False
    # Some ranks only serve (parameter server): they do not train, and the data is split among the rest.
    has_server_ranks: ClassVar[bool] = False
    # dtrain's profiler sees this strategy's communication (FSDP's runs inside its own hooks: unknown).
    comm_measured: ClassVar[bool] = True
    # How replicas talk, recorded in profile.json for the cost model: one of the record's ALL_REDUCE, SERVER
    # and SHARDED (dtrain.profiling.record says what each is and how the cost model treats it).
    exchange: ClassVar[str] = ALL_REDUCE
    # The strategy the registry builds in its place in a world of one, by name (None: itself): for one whose
    # one slot is plain training, "single_device" (no wrapper, buckets or hooks: sync/single.py).
    one_slot_stand_in: ClassVar[str | None] = None
    # Trains one slot only (single_device): not offered where strategies are listed to choose from.
    one_slot_only: ClassVar[bool] = False
    # A forward takes every rank (FSDP gathers each layer's shards from all of them): no rank can run the
    # model alone (a chief-only evaluation, a one-rank probe).
    forward_needs_every_rank: ClassVar[bool] = False

    is_server: bool = False
    dp_group: Any = None  # None: every rank

    def __init__(self, device: torch.device, recorder: CommRecorder = NULL_RECORDER) -> None:
        self.device = device
        self.recorder = recorder

    @classmethod
    def from_config(cls, config: StrategyConfig | None, device: torch.device,
                    recorder: CommRecorder = NULL_RECORDER) -> SyncStrategy:
        """Build from the experiment config (``None``: ``dtrain.init()``'s defaults)."""
        return cls(device, recorder)

    @classmethod
    def standing_in(cls, configured: type[SyncStrategy], config: StrategyConfig | None, device: torch.device,
                    recorder: CommRecorder = NULL_RECORDER) -> SyncStrategy:
        """Built in place of ``configured`` (whose ``one_slot_stand_in`` names this class) in a world of one."""
        return cls.from_config(config, device, recorder)

    @classmethod
    def training_slots(cls, config: StrategyConfig) -> int:
        """How many of the job's slots train (and share each global batch)."""
        return config.resources.slots_per_trial

    @classmethod
    def check_config(cls, config: StrategyConfig) -> None:
        """Raise ValueError (one line, naming the key and the fix) for settings this strategy cannot honour."""
        o = config.optimizations
        if o.gradient_compression not in cls.compressions:
            honoured = ", ".join(sorted(cls.compressions - {"none"})) or "none"
            raise ValueError(f"sync.strategy {cls.name!r} cannot honour gradient_compression "
                             f"{o.gradient_compression!r} (it supports: {honoured}); change "
                             "optimizations.gradient_compression or use sync.strategy: ddp")
        if o.auto_tune_tensor_fusion and not cls.tunable_fusion:
            raise ValueError(f"auto_tune_tensor_fusion tunes DDP's buckets; sync.strategy {cls.name!r} cannot "
                             "honour it: set optimizations.auto_tune_tensor_fusion: false")

    @property
    def dp_rank(self) -> int:

        return ddist.rank()

    @property
    def dp_world(self) -> int:

        return ddist.world_size()

    @property
    def fusion_threshold_mb(self) -> float | None:
        """The gradient message size in use (MB), where the strategy fuses gradients."""
        return None

    def refresh(self) -> None:
        """Make this rank's weights current before validating or checkpointing (asynchronous strategies)."""
        return None

    @abstractmethod
    def setup_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device and wrap it so that its replicas stay in sync."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever wrapper :meth:`setup_model` returned."""
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient exchange inside this block (for gradient aggregation)."""
        yield

    def exchange_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the update: strategies that do not communicate during backward do it here."""
        return None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After the update: e.g. periodic weight averaging."""
        return None

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full, unsharded state dict of the user's module. Called on every rank (may be collective);
        only the chief's result is written."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        self.unwrap(model).load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """This rank's strategy state that a checkpoint must keep (compression buffers, ...)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


@runtime_checkable
class Rebucketable(Protocol):
    """Optional capability: change the gradient bucket size mid-run (for fusion auto-tuning)."""

    def rebuild(self, model: nn.Module, bucket_cap_mb: float) -> None: ...


@runtime_checkable
class Serving(Protocol):
    """Optional capability of strategies with server ranks: what a server rank runs instead of training."""

    def serve_run(self, optimizer: torch.optim.Optimizer, schedule: Iterator[tuple[int, bool, bool, bool]],
                  checkpoint: Any, batches: int) -> None: ...

    def write_stats(self, run_dir: Path) -> None: ...


def broadcast_from_chief(model: nn.Module) -> None:
    """Make every replica start from rank 0's parameters and buffers (what DDP does at construction)."""
    import torch.distributed as dist

    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)
