"""The handle user code gets: one engine underneath both user APIs.

* :func:`dtrain.init` returns a :class:`DistributedContext` for an existing training loop;
* a :class:`~dtrain.engine.trial.PyTorchTrial` is built with a :class:`TrialContext`, the same engine plus the
  experiment's hyperparameters and batch sizes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dtrain import dist as ddist
from dtrain.config.schema import ExperimentConfig
from dtrain.engine import checkpoint, data, hostmemory, schedulers
from dtrain.engine.hparams import HparamReads
from dtrain.engine.metrics import MeanAccumulator
from dtrain.engine.nonfinite import NonFiniteError, gradients_nonfinite
from dtrain.engine.precision import make_precision
from dtrain.engine.rollcall import RollCall
from dtrain.engine.seeding import rank_seed, seed_everything
from dtrain.engine.state import PendingRestore, TrainingState
from dtrain.engine.watchdog import STATUS
from dtrain.errors import CheckpointError
from dtrain.profiling import NULL_RECORDER, DDPTiming
from dtrain.profiling.warmup import FirstStepsTimer
from dtrain.sync import registry
from dtrain.sync.base import SyncStrategy

log = logging.getLogger(__name__)
M = TypeVar("M", bound=nn.Module)
_NOTHING = contextlib.nullcontext()  # reusable: holds no state
Clip = float | Callable[[list[torch.Tensor]], Any] | None  # a max gradient norm, or a function of the parameters


@contextlib.contextmanager
def _no_sync(strategy: SyncStrategy, models: list[nn.Module]) -> Iterator[None]:
    """Every model's ``strategy.no_sync`` entered together (only on accumulating steps)."""
    with contextlib.ExitStack() as stack:
        for model in models:
            stack.enter_context(strategy.no_sync(model))
        yield


Split = Literal["train", "eval"]


class DistributedContext:
    """Rank, device, model/optimizer wrapping, sharded loaders, precision, metric reduction, checkpoints."""

    def __init__(self, backend: str = "auto", timeout_seconds: float = 300.0, seed: int = 0,
                 config: ExperimentConfig | None = None, profile: bool = True, warmup_steps: int = 3,
                 precision: str = "32-true") -> None:
        self.env = ddist.read_env()
        self.backend = ddist.resolve_backend(backend, self.env.local_world_size, warn=False)
        self.device = ddist.device_for(self.backend, self.env)
        self.num_threads = ddist.limit_cpu_threads(self.env)
        hostmemory.keep_freed_memory()  # a step's memory is reused, not faulted in anew
        ddist.init_process_group(self.env, self.backend, timeout_seconds)
        self.seed = seed
        self.precision = make_precision(precision, self.device)
        self.timer = FirstStepsTimer(self.device, enabled=profile, warmup_steps=warmup_steps,
                               sample_every=config.profiling.sample_every if config is not None else 1)
        opts = config.optimizations if config is not None else None
        self.aggregation_frequency = opts.aggregation_frequency if opts is not None else 1
        self.average_aggregated_gradients = opts.average_aggregated_gradients if opts is not None else True
        # optimizations.on_nonfinite: skip (None: the own-loop API, which leaves it to the user's code).
        self.skip_nonfinite = opts is not None and opts.on_nonfinite == "skip"
        self.max_nonfinite_skips = opts.max_nonfinite_skips if opts is not None else 0
        self.nonfinite_skipped = False  # whether the last optimizer step was skipped for non-finite gradients
        self.nonfinite_in_row = 0
        self.zero_grads = True  # False: the trial zeroes gradients itself (Determined's auto_zero_grads=False)
        self.strategy: SyncStrategy = registry.build(config, self.device,
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
        self.lr_wrapped: list[schedulers.LRScheduler] = []  # with when the Trial's loop steps each
        # Calls so far: a trial that calls loss.backward() / opt.step() itself leaves them at 0 (see
        # dtrain.engine.firstbatch); one add per call.
        self.backward_calls = self.step_optimizer_calls = 0
        self._samplers: list[data.ResumableDistributedSampler] = []
        # Optimizer steps taken (names checkpoints saved without ``batches``; restored with them).
        self.optimizer_steps = 0
        # A checkpoint loaded before its models/optimizers were wrapped: applied as they are.
        self._pending: PendingRestore | None = None
        self.rollcall = RollCall(self.rank, self.world_size, timeout_seconds)
        if self.rollcall.active:
            atexit.register(_close_quietly, self.rollcall)  # a script that ends without ctx.close()

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
        self._apply_pending()
        return wrapped  # type: ignore[return-value]

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer = self.strategy.setup_optimizer(optimizer)
        self.optimizers.append(optimizer)
        self._apply_pending()
        return optimizer

    # The own loop steps its schedulers itself; a Trial's loop steps them every batch unless told otherwise.
    default_step_mode = schedulers.StepMode.MANUAL_STEP
    _loop_steps_schedulers = False

    def wrap_lr_scheduler(self, scheduler: Any, step_mode: Any = None, frequency: int = 1) -> Any:
        """Register an LR scheduler: checkpoints save and restore it, and a Trial's loop steps it.

        ``step_mode`` (:class:`dtrain.engine.schedulers.StepMode`, as Determined's
        ``LRScheduler.StepMode``, or its name: ``"step_every_batch"``, ``"step_every_optimizer_step"``,
        ``"step_every_epoch"``, ``"manual_step"``): in a Trial, every batch by default, after
        ``train_batch``, once per ``frequency`` of them; with :func:`dtrain.init` only ``manual_step`` (the
        default): call ``scheduler.step()`` yourself. Returns ``scheduler`` itself.
        """
        wrapped = schedulers.wrap(scheduler, step_mode, frequency, self.default_step_mode,
                                  self._loop_steps_schedulers)
        self.lr_schedulers.append(scheduler)
        self.lr_wrapped.append(wrapped)
        self._apply_pending()
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
    def loader(self, dataset: Dataset, batch_size: int, split: Split | None = None, num_workers: int = 0, *,
               pin_memory: bool | None = None, drop_last: bool | None = None,
               collate_fn: Callable[[list[Any]], Any] | None = None, persistent_workers: bool = False,
               prefetch_factor: int | None = None, shuffle: bool | None = None, **options: Any) -> DataLoader:
        """A DataLoader over this slot's shard of ``dataset``; ``batch_size`` is per slot.

        ``split="train"`` (default): every slot draws the same seeded permutation (``seed`` of
        :func:`dtrain.init`) and takes its share; call :meth:`set_epoch` each epoch. Every slot gets the
        same number of batches. With ``drop_last`` (default) only full global batches are used, so N slots
        x B/N train exactly as 1 slot x B; ``drop_last=False`` keeps the epoch's tail as one last, smaller
        batch per slot, padded with repeated records as torch's ``DistributedSampler`` does (that batch
        then differs from one slot's).
        ``split="eval"``: each record exactly once across slots, in order; shards and last batches may be
        uneven, so weight metrics by batch size in :meth:`reduce`.
        ``pin_memory`` defaults to on with CUDA; ``num_workers``, ``collate_fn``, ``persistent_workers``,
        ``prefetch_factor`` and further ``options`` go to the DataLoader as given. ``shuffle`` is the old
        name of ``split`` (True: train, False: eval), kept for now.
        """
        split = data.loader_split(split, shuffle)
        dp_rank, dp_world = self.strategy.dp_rank, self.strategy.dp_world
        pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        kwargs = dict(num_workers=num_workers, pin_memory=pin, collate_fn=collate_fn,
                      persistent_workers=persistent_workers, prefetch_factor=prefetch_factor, **options)
        if split == "eval":
            return data.eval_loader(dataset, batch_size, dp_rank, dp_world, drop_last=bool(drop_last), **kwargs)
        loader, sampler = data.train_loader(dataset, batch_size, dp_rank, dp_world, self.seed,
                                            drop_last=drop_last is not False, **kwargs)
        sampler.on_epoch_start = self.rollcall.epoch_started
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
        self.backward_calls += 1
        if self.aggregation_frequency > 1 and self.average_aggregated_gradients:
            loss = loss / self.aggregation_frequency
        loss = self.precision.scale(loss)
        # Named for the launcher should a peer stop answering while this rank waits here.
        before = STATUS.phase
        STATUS.enter("backward (gradient all-reduce)" if self.sync_gradients and not self.strategy.exchanges_in_step
                     else "backward")
        self.timer.backward_begin()
        loss.backward(**kwargs)
        self.timer.backward_end()
        STATUS.enter(before)

    def gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        """Run one batch (forward *and* backward: DDP decides in forward whether backward communicates)
        either exchanging gradients or only accumulating them locally: ``with ctx.gradient_sync(False):``.

        A plain method rather than a generator context manager: the trainer enters it every step, and an
        exchanging step (the usual case) needs nothing entered, so it gets one shared null context."""
        self.sync_gradients = sync
        self.timer.exchanging = sync  # only exchanging steps tell how late each rank arrives
        return _NOTHING if sync else _no_sync(self.strategy, self.models)

    def step_optimizer(self, optimizer: torch.optim.Optimizer, clip_grad_norm: Clip = None) -> None:
        """Optional gradient clipping (a max norm, or a callable given the parameters), ``optimizer.step()``
        and ``zero_grad``: only on the last batch of an aggregation group (every batch when
        ``aggregation_frequency`` is 1). With ``16-mixed``, gradients are unscaled first and a step that
        overflowed on any rank is skipped on every rank."""
        self.step_optimizer_calls += 1
        if not self.sync_gradients:
            return
        if self._pending is not None:
            self._check_pending_applied()
        self.optimizer_steps += 1
        self.nonfinite_skipped = False
        before = STATUS.phase
        # Phase edges are plain laps, not context managers: this runs every step, and a few microseconds
        # count on small, fast steps (an exception ends the run, so an unfinished step's timing is moot).
        self.timer.lap("other")  # train_batch's own code since backward
        if self.strategy.exchanges_in_step:
            self._exchange_and_update(optimizer, clip_grad_norm)
        else:
            STATUS.enter("optimizer step")
            self._update(optimizer, clip_grad_norm)
            self.timer.lap("optimizer")
        STATUS.enter(before)

    def _exchange_and_update(self, optimizer: torch.optim.Optimizer, clip_grad_norm: Clip) -> None:
        """For strategies that communicate around the update (parameter server, local SGD, explicit
        all-reduce): each exchange is timed as exposed communication."""
        timer, strategy, precision = self.timer, self.strategy, self.precision
        skip = False
        if precision.scaler is not None:
            # Unscale before the exchange, so that servers and averagers see true gradients.
            skip = precision.unscale_and_check(optimizer, strategy.dp_group)
            timer.lap("optimizer")
        STATUS.enter("gradient exchange")
        strategy.exchange_gradients(optimizer)
        timer.lap("comm_exposed")
        STATUS.enter("optimizer step")
        if self.skip_nonfinite and precision.scaler is None and not strategy.has_server_ranks:
            skip = self._skip_nonfinite(optimizer)
        self._apply(optimizer, clip_grad_norm, skip)
        timer.lap("optimizer")
        STATUS.enter("weight sync")
        strategy.after_step(optimizer)  # before zero_grad: torch's averager skips grad-less params
        timer.lap("comm_exposed")
        if self.zero_grads:
            optimizer.zero_grad(set_to_none=True)
        timer.lap("optimizer")

    def _local_skip(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether to skip this update (gradients already exchanged in backward): overflow or non-finite."""
        if self.precision.scaler is not None:
            return self.precision.unscale_and_check(optimizer, self.strategy.dp_group)
        if self.skip_nonfinite and not self.strategy.has_server_ranks:
            return self._skip_nonfinite(optimizer)
        return False

    def _update(self, optimizer: torch.optim.Optimizer, clip_grad_norm: Clip) -> None:
        """The update of a strategy whose gradients were exchanged in backward (its hooks still called)."""
        strategy = self.strategy
        strategy.exchange_gradients(optimizer)
        self._apply(optimizer, clip_grad_norm, self._local_skip(optimizer))
        strategy.after_step(optimizer)
        if self.zero_grads:
            optimizer.zero_grad(set_to_none=True)

    def _apply(self, optimizer: torch.optim.Optimizer, clip_grad_norm: Clip, skip: bool) -> None:
        """Clip, step unless skipped, and let the loss scaler adapt."""
        if clip_grad_norm is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            if callable(clip_grad_norm):
                clip_grad_norm(params)
            else:
                torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
        if not skip:
            self.strategy.step(optimizer)
        self.precision.update()

    def _skip_nonfinite(self, optimizer: torch.optim.Optimizer) -> bool:
        """``on_nonfinite: skip``: the same verdict on every rank; fail after too many skips in a row."""
        strategy = self.strategy
        replicated = not (strategy.replicas_may_differ or strategy.per_rank_optimizer_state)
        self.nonfinite_skipped = gradients_nonfinite(optimizer, strategy.dp_group, replicated, self.device)
        self.nonfinite_in_row = self.nonfinite_in_row + 1 if self.nonfinite_skipped else 0
        if self.nonfinite_in_row > self.max_nonfinite_skips:
            raise NonFiniteError(f"non-finite gradients in {self.nonfinite_in_row} optimizer steps in a row, up to "
                                 f"batch {STATUS.batch}: each was skipped (optimizations.on_nonfinite: skip) but "
                                 f"optimizations.max_nonfinite_skips is {self.max_nonfinite_skips}; lower the learning "
                                 "rate or clip gradients", None)
        return self.nonfinite_skipped

    # --------------------------------------------------------------------------------------- metrics
    def reduce(self, metrics: Mapping[str, Any], weight: float = 1.0) -> dict[str, float]:
        """Weighted mean of each metric across slots (collective: every rank calls it with the same keys)."""
        acc = MeanAccumulator()
        acc.add(metrics, weight)
        return acc.global_means(self.strategy.dp_group)

    def barrier(self) -> None:
        ddist.barrier()

    # ----------------------------------------------------------------------------------- checkpoints
    def training_state(self) -> TrainingState:
        """What a checkpoint saves and restores for this rank (see :class:`dtrain.engine.state.TrainingState`)."""
        return TrainingState(self.strategy, self.models, self.optimizers, self.lr_schedulers,
                                        self.precision, self.rank, self.world_size)

    def save_checkpoint(self, directory: str | Path, batches: int | None = None,
                        extra: Mapping[str, Any] | None = None, keep_last: int = 2,
                        rank_extra: Mapping[str, Any] | None = None) -> Path:
        """Save wrapped models, optimizers, schedulers, RNG streams and ``extra`` under
        ``directory/<batches>`` (default: the optimizer steps taken so far) and return that folder.

        **Every rank calls it** (it is collective; rank 0 writes the shared files, each rank its own RNG
        state). Called under ``if rank == 0`` it fails in seconds, naming the ranks that went on without
        it, instead of hanging. The folder appears complete or not at all; ``keep_last`` are kept.
        ``extra`` (rank 0's) comes back from :meth:`load_checkpoint`; ``rank_extra`` is kept per rank.
        """
        self.rollcall.arrive()
        steps = self.optimizer_steps
        return self.training_state().save(Path(directory), steps if batches is None else batches,
                                          dict(extra or {}), keep_last, dict(rank_extra or {}),
                                          optimizer_steps=steps)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore models, optimizers, schedulers and RNG streams from a checkpoint folder (or a folder
        holding ``latest``); returns the ``extra`` mapping saved with it.

        Call it before or after :meth:`setup`: what is not wrapped yet is restored when it gets wrapped
        (a step taken before then is an error). Every rank loads, from files every rank can read.
        """
        pending = self.training_state().pending_restore(Path(path))
        self._pending = pending
        steps = pending.loaded.trainer_state.get("optimizer_steps")
        self.optimizer_steps = int(steps) if steps is not None else self.optimizer_steps
        self._apply_pending()
        return pending.restored.extra

    @staticmethod
    def latest_checkpoint(directory: str | Path) -> Path | None:
        """The newest complete checkpoint folder under ``directory``, or None (no folder, none saved yet):
        ``if (ckpt := ctx.latest_checkpoint(d)): ctx.load_checkpoint(ckpt)``."""
        return checkpoint.newest_complete(Path(directory))

    def _apply_pending(self) -> None:
        if self._pending is not None:
            self._pending.apply(self.training_state())

    def _check_pending_applied(self) -> None:
        pending, self._pending = self._pending, None  # from the first step on, later wraps are new objects
        missing = pending.missing() if pending is not None else None
        if missing is not None:
            raise CheckpointError(f"checkpoint {pending.path} was loaded but not fully applied before the first "
                                  f"optimizer step ({missing}): wrap every model and optimizer (ctx.setup) "
                                  "before training")

    # --------------------------------------------------------------------------------- randomness
    def rank_generator(self, device: str | torch.device | None = None) -> torch.Generator:
        """A torch.Generator of its own for this rank, seeded from ``seed`` and the rank: for per-rank
        randomness (noise, augmentation, synthetic data) that must differ between ranks. The global RNGs
        are seeded alike on every rank by :func:`init`. Same seed and rank, same stream."""
        generator = torch.Generator(device=device if device is not None else "cpu")
        return generator.manual_seed(rank_seed(self.seed, self.rank))

    def close(self) -> None:
        """Leave the job. The wrapped models go first: a DDP (and its reducer) outliving the process group
        can deadlock Gloo's teardown, which joins threads that need the Python lock."""
        self.rollcall.close()
        self.models.clear()
        self.optimizers.clear()
        self.lr_schedulers.clear()
        self.lr_wrapped.clear()
        self._samplers.clear()
        self.strategy = None  # type: ignore[assignment]
        import gc

        gc.collect()
        ddist.destroy_process_group()


class TrialContext(DistributedContext):
    """What a :class:`~dtrain.engine.trial.PyTorchTrial` is built with: the engine plus the experiment."""

    default_step_mode = schedulers.StepMode.STEP_EVERY_BATCH
    _loop_steps_schedulers = True
    run_dir: Path | None = None  # the run's directory, once the loop is given one

    def __init__(self, config: ExperimentConfig) -> None:
        super().__init__(backend=config.backend, timeout_seconds=config.resources.collective_timeout_seconds,
                         seed=config.seed, config=config, profile=config.profiling.enabled,
                         warmup_steps=config.profiling.warmup_steps, precision=config.precision)
        self.config = config
        self.hparam_reads = HparamReads(config.hyperparameters)  # which ones the trial reads
        # Slots that train: all of them, except a parameter server's server ranks.
        # The launcher warned about a remainder before any worker started; only a count it could not know
        # (a parameter server's servers hold no data) is worth saying again, by the chief.
        dp_world = self.strategy.dp_world
        warn = self.is_chief and dp_world != config.resources.slots_per_trial
        self.per_slot_batch_size = data.per_slot_batch_size(config.global_batch_size, dp_world, warn=warn)

    def get_hparams(self) -> dict[str, Any]:
        """The experiment's hyperparameters, a dict of the trial's own; the keys read through it are noted
        (see :mod:`dtrain.engine.hparams`)."""
        return self.hparam_reads.get_hparams()

    def get_hparam(self, name: str) -> Any:
        """One hyperparameter; a name the config does not set is a one-line error."""
        return self.hparam_reads.get_hparam(name)

    def get_per_slot_batch_size(self) -> int:
        return self.per_slot_batch_size

    def get_global_batch_size(self) -> int:
        """The effective global batch: per-slot batch x training slots (a remainder is dropped)."""
        return self.per_slot_batch_size * self.strategy.dp_world

    def get_experiment_config(self) -> ExperimentConfig:
        return self.config


def init(backend: str = "auto", timeout_seconds: float = 300.0, seed: int = 0, precision: str = "32-true",
         quiet: bool = False) -> DistributedContext:
    """Join the job started by ``dtrain launch`` / ``torchrun`` (or a world of one) and return its context.

    ``seed`` seeds torch's, numpy's and Python's global RNGs **alike on every rank** (so models start
    equal), and the training loaders' shuffling; for randomness that must differ between ranks use
    :meth:`DistributedContext.rank_generator`. Rank 0 says so in one line on stderr (``quiet`` silences it).
    ``precision`` is one of ``32-true``, ``tf32``, ``bf16-mixed``, ``16-mixed`` (CUDA); ``timeout_seconds``
    bounds every collective.
    """
    seed_everything(seed)
    # No step profiler: an own loop does not mark its steps, so timing hooks would cost without telling.
    ctx = DistributedContext(backend=backend, timeout_seconds=timeout_seconds, seed=seed, precision=precision,
                             profile=False)
    message = (f"seed {seed}: torch, numpy and random global RNGs seeded alike on all {ctx.world_size} rank(s) "
               "(equal initial weights, equal draws); ctx.rank_generator() gives each rank its own stream")
    log.info("%s", message)
    if ctx.is_chief and not quiet:
        print(f"dtrain: {message}", file=sys.stderr, flush=True)
    return ctx


def _close_quietly(rollcall: RollCall) -> None:
    # At exit the store may be gone already; then nothing waits on this rank's record either.
    with contextlib.suppress(Exception):
        rollcall.close()
