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
from dtrain.profiler import StepTimer
from dtrain.sync import SyncStrategy, build_strategy

log = logging.getLogger(__name__)
M = TypeVar("M", bound=nn.Module)


class DistributedContext:
    """Rank, device, model/optimizer wrapping, sharded loaders, metric reduction, checkpoints."""

    def __init__(self, backend: str = "auto", timeout_seconds: float = 300.0, seed: int = 0,
                 config: ExperimentConfig | None = None, profile: bool = True, warmup_steps: int = 3) -> None:
        self.env = ddist.read_env()
        self.backend = ddist.resolve_backend(backend)
        self.device = ddist.device_for(self.backend, self.env)
        self.num_threads = ddist.limit_cpu_threads(self.env)
        ddist.init_process_group(self.env, self.backend, timeout_seconds)
        self.seed = seed
        self.timer = StepTimer(self.device, enabled=profile, warmup_steps=warmup_steps)
        self.strategy: SyncStrategy = build_strategy(config, self.device,
                                                     self.timer.recorder if profile else None)
        opts = config.optimizations if config is not None else None
        self.aggregation_frequency = opts.aggregation_frequency if opts is not None else 1
        self.average_aggregated_gradients = opts.average_aggregated_gradients if opts is not None else True
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
        """Move to this slot's device and wrap for synchronous data parallelism (DDP by default)."""
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

    # ---------------------------------------------------------------------------------------- data
    def loader(self, dataset: Dataset, batch_size: int, shuffle: bool = True, num_workers: int = 0) -> DataLoader:
        """A per-slot loader over this rank's shard. ``batch_size`` is per slot.

        With ``shuffle`` (training), every rank draws the same seeded permutation and takes its share, full
        batches only; call :meth:`set_epoch` each epoch. Without it (evaluation), each record is seen once.
        """
        if not shuffle:
            return data.eval_loader(dataset, batch_size, self.rank, self.world_size, num_workers)
        loader, sampler = data.train_loader(dataset, batch_size, self.rank, self.world_size, self.seed, num_workers)
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
        the update equals one step on a k times bigger batch.
        """
        if self.aggregation_frequency > 1 and self.average_aggregated_gradients:
            loss = loss / self.aggregation_frequency
        with self.timer.backward():
            loss.backward(**kwargs)

    @contextlib.contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        """Run one batch (forward *and* backward: DDP decides in forward whether backward communicates)
        either exchanging gradients or only accumulating them locally."""
        self.sync_gradients = sync
        with contextlib.ExitStack() as stack:
            if not sync:
                for model in self.models:
                    stack.enter_context(self.strategy.no_sync(model))
            yield

    def step_optimizer(self, optimizer: torch.optim.Optimizer, clip_grad_norm: float | None = None) -> None:
        """Optional gradient clipping, ``optimizer.step()`` and ``zero_grad``: only on the last batch of an
        aggregation group (every batch when ``aggregation_frequency`` is 1)."""
        if not self.sync_gradients:
            return
        communicates = self.strategy.exchanges_in_step
        with self.timer.phase("comm_exposed" if communicates else "optimizer", before="other"):
            self.strategy.exchange_gradients(optimizer)
        with self.timer.phase("optimizer", before="other"):
            if clip_grad_norm is not None:
                params = [p for g in optimizer.param_groups for p in g["params"]]
                torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
            self.strategy.step(optimizer)
        with self.timer.phase("comm_exposed" if communicates else "optimizer", before="other"):
            self.strategy.after_step(optimizer)  # before zero_grad: torch's averager skips grad-less params
        with self.timer.phase("optimizer", before="other"):
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
    def save_checkpoint(self, directory: str | Path, batches: int, extra: Mapping[str, Any] | None = None,
                        keep_last: int = 2, rank_extra: Mapping[str, Any] | None = None) -> Path:
        """Collective: save wrapped models, optimizers, schedulers and ``extra`` (chief's) under
        ``directory/<batches>``; ``rank_extra`` is kept per rank, beside that rank's RNG state."""
        models = [self.strategy.model_state_dict(m) for m in self.models]  # may be collective (FSDP)
        payload = None
        if self.is_chief:
            payload = checkpoint.CheckpointPayload(
                batches=batches,
                models=models,
                optimizers=self._optimizer_states(),
                trainer_state={"extra": dict(extra or {})},
                metadata={"world_size": self.world_size, "strategy": self.strategy.name},
            )
        # Strategy state (e.g. PowerSGD error feedback) differs between ranks: it is saved per rank, and so
        # are weights and optimizer state when the strategy lets them differ (local SGD, FSDP shards).
        rank_state: dict[str, Any] = {"batches": batches, "rng": checkpoint.rng_state(),
                                      "extra": dict(rank_extra or {}), "strategy": self.strategy.state_dict()}
        if self.strategy.replicas_may_differ:
            rank_state["models"] = [self.unwrap(m).state_dict() for m in self.models]
        if self.strategy.per_rank_optimizer_state:
            rank_state["optimizers"] = self._optimizer_states()
        return checkpoint.save(Path(directory), payload, rank_state, self.rank, keep_last)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore models, optimizers, schedulers and RNG from a checkpoint folder (or a folder holding
        ``latest``); returns the ``extra`` mapping that was saved with it."""
        loaded = self.restore(Path(path))
        return dict(loaded.trainer_state.get("extra", {}))

    def restore(self, path: Path) -> checkpoint.LoadedCheckpoint:
        if (path / checkpoint.LATEST).is_file():
            found = checkpoint.latest(path)
            if found is None:
                raise UserError(f"{path}/latest names a checkpoint that does not exist; point at a checkpoint folder")
            path = found
        if not (path / "metadata.json").exists():
            raise UserError(f"{path} is not a dtrain checkpoint (no metadata.json); pass a checkpoint folder")
        loaded = checkpoint.load(path, self.rank)
        self._check_counts(loaded, path)
        same_layout = (loaded.rank_state is not None and loaded.metadata.get("world_size") == self.world_size
                       and loaded.metadata.get("strategy", self.strategy.name) == self.strategy.name)
        rank_state = loaded.rank_state if same_layout and loaded.rank_state is not None else {}
        for model, state in zip(self.models, rank_state.get("models", loaded.models), strict=True):
            self.strategy.load_model_state_dict(model, state)
        optimizer_states = rank_state.get("optimizers", loaded.optimizers)
        if self.strategy.per_rank_optimizer_state and "optimizers" not in rank_state:
            raise UserError(f"checkpoint {path} has no optimizer state for rank {self.rank} of "
                            f"{self.world_size} ({self.strategy.name} keeps it per rank); resume with "
                            f"{loaded.metadata.get('world_size')} slots and the same sync.strategy")
        n_opt = len(self.optimizers)
        for opt, state in zip(self.optimizers, optimizer_states[:n_opt], strict=True):
            opt.load_state_dict(state)
        for sched, state in zip(self.lr_schedulers, optimizer_states[n_opt:], strict=False):
            sched.load_state_dict(state)
        if same_layout:
            checkpoint.set_rng_state(rank_state["rng"])
            self.strategy.load_state_dict(rank_state.get("strategy", {}))
        elif self.is_chief:
            log.warning("checkpoint was written by %s slots, this job has %d: RNG streams are reseeded, so the "
                        "result will not be bit-identical to an uninterrupted run",
                        loaded.metadata.get("world_size"), self.world_size)
        return loaded

    def _optimizer_states(self) -> list[dict[str, Any]]:
        return [o.state_dict() for o in self.optimizers] + [s.state_dict() for s in self.lr_schedulers]

    def _check_counts(self, loaded: checkpoint.LoadedCheckpoint, path: Path) -> None:
        if len(loaded.models) != len(self.models):
            raise UserError(f"checkpoint {path} holds {len(loaded.models)} model(s) but this code wrapped "
                            f"{len(self.models)}; resume with the same trial code")
        if len(loaded.optimizers) < len(self.optimizers):
            raise UserError(f"checkpoint {path} holds {len(loaded.optimizers)} optimizer state(s) but this code "
                            f"wrapped {len(self.optimizers)}; resume with the same trial code")

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
                         warmup_steps=config.profiling.warmup_steps)
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


def init(backend: str = "auto", timeout_seconds: float = 300.0, seed: int = 0) -> DistributedContext:
    """Join the job started by ``dtrain launch`` / ``torchrun`` (or a world of one) and return its context."""
    torch.manual_seed(seed)
    return DistributedContext(backend=backend, timeout_seconds=timeout_seconds, seed=seed)
