"""The handle user code gets: one engine underneath both user APIs.

* :func:`dtrain.init` returns a :class:`DistributedContext` for an existing training loop;
* a :class:`~dtrain.trial.PyTorchTrial` is built with a :class:`TrialContext`, the same engine plus the
  experiment's hyperparameters and batch sizes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dtrain import checkpoint, data
from dtrain import dist as ddist
from dtrain.config import ExperimentConfig
from dtrain.errors import UserError
from dtrain.metrics import MeanAccumulator
from dtrain.precision import Precision
from dtrain.profiling import NULL_RECORDER, DDPTiming, StepTimer
from dtrain.sync import SyncStrategy, build_strategy

log = logging.getLogger(__name__)
M = TypeVar("M", bound=nn.Module)


class DistributedContext:
    """Rank, device, model/optimizer wrapping, sharded loaders, precision, metric reduction, checkpoints."""

    def __init__(self, backend: str = "auto", timeout_seconds: float = 300.0, seed: int = 0,
                 config: ExperimentConfig | None = None, profile: bool = True, warmup_steps: int = 3,
                 precision: str = "32-true") -> None:
        self.env = ddist.read_env()
        self.backend = ddist.resolve_backend(backend, self.env.local_world_size, warn=False)
        self.device = ddist.device_for(self.backend, self.env)
        self.num_threads = ddist.limit_cpu_threads(self.env)
        ddist.init_process_group(self.env, self.backend, timeout_seconds)
        self.seed = seed
        self.precision = Precision(precision, self.device)
        self.timer = StepTimer(self.device, enabled=profile, warmup_steps=warmup_steps)
        opts = config.optimizations if config is not None else None
        self.aggregation_frequency = opts.aggregation_frequency if opts is not None else 1
        self.average_aggregated_gradients = opts.average_aggregated_gradients if opts is not None else True
        self.strategy: SyncStrategy = build_strategy(config, self.device,
                                                     self.timer.recorder if profile else NULL_RECORDER)
        if profile and hasattr(self.strategy, "timing"):
            # Profiling attaches its DDP timing from this side; DDP's own timers only sample iterations that
            # synchronize, so gradient aggregation needs per-bucket stamps instead.
            self.strategy.timing = DDPTiming(self.timer.recorder, native=self.aggregation_frequency == 1)
        # False while accumulating gradients of a batch that is not the last of its aggregation group: the
        # trainer sets it before each batch.
        self.sync_gradients = True
        self.models: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers: list[Any] = []
        self._samplers: list[data.ResumableDistributedSampler] = []

    # ------------------------------------------------------------------------------------------ where
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_chief(self) -> bool:
        return self.env.is_chief

    def get_rank(self) -> int:
        return self.rank

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_device(self) -> torch.device:
        return self.device

    # ------------------------------------------------------------------------------------- wrapping
    def wrap_model(self, model: M) -> M:
        """Move to this slot's device and wrap for synchronous data parallelism (DDP by default); with a
        mixed ``precision``, its forward runs under autocast."""
        self.precision.wrap_forward(model)
        wrapped = self.strategy.setup_model(model)
        self.models.append(wrapped)
        return wrapped  # type: ignore[return-value]

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer = self.strategy.setup_optimizer(optimizer)
        self.optimizers.append(optimizer)
        return optimizer

    def wrap_lr_scheduler(self, scheduler: Any) -> Any:
        """Register an LR scheduler so that checkpoints save and restore it; you still call ``step()``."""
        self.lr_schedulers.append(scheduler)
        return scheduler

    def setup(self, model: M, *optimizers: torch.optim.Optimizer) -> Any:
        """``model, opt = ctx.setup(model, opt)``: wrap both in one call (optimizer built on model params)."""
        wrapped = self.wrap_model(model)
        return (wrapped, *(self.wrap_optimizer(o) for o in optimizers)) if optimizers else wrapped

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.strategy.unwrap(model)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``with ctx.autocast():`` the run's mixed precision for code outside the wrapped model."""
        return self.precision.autocast()

    # ---------------------------------------------------------------------------------------- data
    def loader(self, dataset: Dataset, batch_size: int, shuffle: bool = True, num_workers: int = 0) -> DataLoader:
        """A per-slot loader over this slot's shard. ``batch_size`` is per slot.

        With ``shuffle`` (training), every slot draws the same seeded permutation and takes its share, full
        batches only; call :meth:`set_epoch` each epoch. Without it (evaluation), each record is seen once.
        Slots are the training ranks (a parameter server's servers hold no data).
        """
        dp_rank, dp_world = self.strategy.dp_rank, self.strategy.dp_world
        pin = self.device.type == "cuda"
        if not shuffle:
            return data.eval_loader(dataset, batch_size, dp_rank, dp_world, num_workers, pin_memory=pin)
        loader, sampler = data.train_loader(dataset, batch_size, dp_rank, dp_world, self.seed, num_workers,
                                            pin_memory=pin)
        self._samplers.append(sampler)
        return loader

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle every training loader made by :meth:`loader` for ``epoch``."""
        for sampler in self._samplers:
            sampler.set_start(epoch, 0)

    def to_device(self, batch: Any) -> Any:
        return data.to_device(batch, self.device)

    # -------------------------------------------------------------------------------------- stepping
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``; DDP averages gradients across slots while it runs.

        With ``aggregation_frequency`` k, gradients of k batches are summed locally (no communication on the
        first k-1) and exchanged once; the loss is divided by k when ``average_aggregated_gradients``, so
        the update equals one step on a k times bigger batch. With ``16-mixed`` the loss is scaled.
        """
        if self.aggregation_frequency > 1 and self.average_aggregated_gradients:
            loss = loss / self.aggregation_frequency
        loss = self.precision.scale(loss)
        with self.timer.backward():
            loss.backward(**kwargs)

    @contextlib.contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        """Run one batch (forward *and* backward: DDP decides in forward whether backward communicates)
        either exchanging gradients or only accumulating them locally."""
        self.sync_gradients = sync
        self.timer.exchanging = sync  # only exchanging steps tell how late each rank arrives
        with contextlib.ExitStack() as stack:
            if not sync:
                for model in self.models:
                    stack.enter_context(self.strategy.no_sync(model))
            yield

    def step_optimizer(self, optimizer: torch.optim.Optimizer, clip_grad_norm: float | None = None) -> None:
        """Optional gradient clipping, ``optimizer.step()`` and ``zero_grad``: only on the last batch of an
        aggregation group (every batch when ``aggregation_frequency`` is 1). With ``16-mixed``, gradients
        are unscaled first and a step that overflowed on any rank is skipped on every rank."""
        if not self.sync_gradients:
            return
        timer, strategy, precision = self.timer, self.strategy, self.precision
        comm = "comm_exposed" if strategy.exchanges_in_step else "optimizer"
        skip = False
        if precision.scaler is not None and strategy.exchanges_in_step:
            # Unscale before the exchange, so that servers and averagers see true gradients.
            with timer.phase("optimizer", before="other"):
                skip = precision.unscale_and_check(optimizer, strategy.dp_group)
        with timer.phase(comm, before="other"):
            strategy.exchange_gradients(optimizer)
        with timer.phase("optimizer", before="other"):
            if precision.scaler is not None and not strategy.exchanges_in_step:
                skip = precision.unscale_and_check(optimizer, strategy.dp_group)
            if clip_grad_norm is not None:
                params = [p for g in optimizer.param_groups for p in g["params"]]
                torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
            if not skip:
                strategy.step(optimizer)
            precision.update()
        with timer.phase(comm, before="other"):
            strategy.after_step(optimizer)  # before zero_grad: torch's averager skips grad-less params
        with timer.phase("optimizer", before="other"):
            optimizer.zero_grad(set_to_none=True)

    # --------------------------------------------------------------------------------------- metrics
    def reduce(self, metrics: Mapping[str, Any], weight: float = 1.0) -> dict[str, float]:
        """Weighted mean of each metric across slots (collective: every rank calls it with the same keys)."""
        acc = MeanAccumulator()
        acc.add(metrics, weight)
        return acc.global_means(self.strategy.dp_group)

    def barrier(self) -> None:
        ddist.barrier()

    # ----------------------------------------------------------------------------------- checkpoints
    def training_state(self) -> checkpoint.TrainingState:
        """What a checkpoint saves and restores for this rank (see :class:`dtrain.checkpoint.TrainingState`)."""
        return checkpoint.TrainingState(self.strategy, self.models, self.optimizers, self.lr_schedulers,
                                        self.precision, self.rank, self.world_size)

    def save_checkpoint(self, directory: str | Path, batches: int, extra: Mapping[str, Any] | None = None,
                        keep_last: int = 2, rank_extra: Mapping[str, Any] | None = None) -> Path:
        """Collective (every rank calls it): save wrapped models, optimizers, schedulers and ``extra``
        (chief's) under ``directory/<batches>``; ``rank_extra`` is kept per rank."""
        return self.training_state().save(Path(directory), batches, dict(extra or {}), keep_last,
                                          dict(rank_extra or {}))

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore models, optimizers, schedulers and RNG from a checkpoint folder (or a folder holding
        ``latest``); returns the ``extra`` mapping that was saved with it."""
        return self.training_state().restore(Path(path)).extra

    def close(self) -> None:
        """Leave the job. The wrapped models go first: a DDP (and its reducer) outliving the process group
        can deadlock Gloo's teardown, which joins threads that need the Python lock."""
        self.models.clear()
        self.optimizers.clear()
        self.lr_schedulers.clear()
        self._samplers.clear()
        self.strategy = None  # type: ignore[assignment]
        import gc

        gc.collect()
        ddist.destroy_process_group()


class TrialContext(DistributedContext):
    """What a :class:`~dtrain.trial.PyTorchTrial` is built with: the engine plus the experiment."""

    def __init__(self, config: ExperimentConfig) -> None:
        super().__init__(backend=config.backend, timeout_seconds=config.resources.collective_timeout_seconds,
                         seed=config.seed, config=config, profile=config.profiling.enabled,
                         warmup_steps=config.profiling.warmup_steps, precision=config.precision)
        self.config = config
        # Slots that train: all of them, except a parameter server's server ranks.
        self.per_slot_batch_size = data.per_slot_batch_size(config.global_batch_size, self.strategy.dp_world)

    def get_hparams(self) -> dict[str, Any]:
        return dict(self.config.hyperparameters)

    def get_hparam(self, name: str) -> Any:
        if name not in self.config.hyperparameters:
            known = ", ".join(sorted(self.config.hyperparameters))
            raise UserError(f"hyperparameter {name!r} is not in the config (have: {known}); add it under "
                            "hyperparameters:")
        return self.config.hyperparameters[name]

    def get_per_slot_batch_size(self) -> int:
        return self.per_slot_batch_size

    def get_global_batch_size(self) -> int:
        """The effective global batch: per-slot batch x training slots (a remainder is dropped)."""
        return self.per_slot_batch_size * self.strategy.dp_world

    def get_experiment_config(self) -> ExperimentConfig:
        return self.config


def init(backend: str = "auto", timeout_seconds: float = 300.0, seed: int = 0,
         precision: str = "32-true") -> DistributedContext:
    """Join the job started by ``dtrain launch`` / ``torchrun`` (or a world of one) and return its context.

    ``seed`` seeds torch's global RNG identically on every rank (so weights start equal) and the loaders'
    shuffling; ``precision`` is one of ``32-true``, ``tf32``, ``bf16-mixed``, ``16-mixed`` (CUDA).
    """
    torch.manual_seed(seed)
    # No step profiler: an own loop does not mark its steps, so timing hooks would cost without telling.
    return DistributedContext(backend=backend, timeout_seconds=timeout_seconds, seed=seed, precision=precision,
                              profile=False)
