"""``dtrain check``'s dry run: the trial built in this process, and its data put through the checks each
worker of ``dtrain run`` makes before its first step, for the run's real number of slots.

``dtrain run`` can only see the trial's data inside its workers (the trial builds it). ``dtrain check``
starts no process, so it builds the trial here, in a world of one (a Gloo or NCCL group over an
in-memory store, no launcher variables needed), exactly as rank 0 would: the same seed, context and
entrypoint. The per-slot batch the trial is handed, the data checks and the batches per epoch are those of
the configured training slots, since what the run refuses is the data set against the *global* batch.
Everything this process had before is put back afterwards: no process group, thread count or RNG state
outlives the dry run (``dtrain check`` also runs inside other programs and tests).

What a world of one cannot show: a trial that shards or sizes its data by rank or world size itself, and
the sync strategy's wrapping (a parameter server's roles need several ranks; its trial is built with plain
``ddp`` here).
"""

from __future__ import annotations

import contextlib
import random
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from dtrain import dist as ddist
from dtrain.config.schema import ExperimentConfig
from dtrain.engine import data
from dtrain.engine.callbacks import Callbacks
from dtrain.engine.context import TrialContext
from dtrain.engine.seeding import seed_everything
from dtrain.engine.trial import PyTorchTrial, load_trial_class
from dtrain.errors import UserError
from dtrain.sync import registry


@dataclass(frozen=True)
class DataFacts:
    """What the dry run learnt of the trial's data, for the configured training slots."""

    training_records: int
    validation_records: int | None  # None: the trial validates nothing
    batches_per_epoch: int
    total_batches: int  # max_length in batches


def obstacle() -> str | None:
    """Why the trial cannot be built in this process (None: it can). A process already in a process group
    (or started by a launcher as one of its ranks) would have its own group joined or torn down."""
    if tdist.is_available() and tdist.is_initialized():
        return "this process already belongs to a process group"
    env = ddist.read_env()
    if env.launched or env.world_size != 1:
        return f"this process is rank {env.rank} of {env.world_size} started by a launcher"
    return None


def check_trial_data(config: ExperimentConfig, training_slots: int, per_slot: int) -> DataFacts:
    """Build the trial in-process and run the checks ``dtrain run``'s workers make before training: the
    training data against one global batch of ``per_slot`` x ``training_slots`` records, the validation
    data against the slots, the callbacks. Raises :class:`UserError` with one line (a trial that raises
    while being built: its exception, where it was raised, in one line). Call only when :func:`obstacle`
    is None."""
    built = False  # past the context: what fails from then on is the trial's own code
    try:
        trial_class = load_trial_class(config.entrypoint, config.code_dir)
        with _world_of_one(config, trial_class.context_class) as context:
            built = True
            # A rank of the real run is handed its share of the global batch, not the world of one's.
            context.per_slot_batch_size = per_slot
            trial = trial_class(context)
            try:
                return _check(trial, context, config, training_slots, per_slot)
            finally:
                del trial  # before the context closes (as in a run: models go before the group)
    except UserError:
        raise
    except Exception as exc:  # one line, as a worker's report would give it
        what = (f"entrypoint {config.entrypoint!r}: building the trial as each worker of dtrain run would" if built
                else "making a one-process group to build the trial in (each worker of dtrain run makes one too)")
        fix = "fix the trial" if built else "that is this machine's setup, not the trial"
        raise UserError(f"{what} failed with {type(exc).__name__}: {_first_line(exc)}{_where(exc, config.code_dir)}; "
                        f"{fix} (dtrain --debug check shows the traceback)") from exc


def _check(trial: PyTorchTrial, context: TrialContext, config: ExperimentConfig, training_slots: int,
           per_slot: int) -> DataFacts:
    """The trainer's set-up (:class:`dtrain.engine.trainer.Trainer`), with rank 0's loaders of
    ``training_slots`` made as :meth:`TrialContext.loader` makes them: the same checks, the same messages."""
    options: dict[str, Any] = dict(num_workers=config.data_loader.num_workers,
                                   pin_memory=context.device.type == "cuda", collate_fn=None,
                                   persistent_workers=False, prefetch_factor=None)
    train_set = trial.build_training_data()
    # Making a DataLoader starts none of its worker processes: only iterating it would. torch's multi-line
    # warning on loader processes per core is left out: the preflight says it in one line, with the slots.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        data.train_loader(train_set, per_slot, 0, training_slots, config.seed, drop_last=True, **options)
        val_set = trial.build_validation_data()
        if val_set is not None:
            data.eval_loader(val_set, per_slot, 0, training_slots, drop_last=False, **options)
    per_epoch = data.batches_per_epoch(train_set, per_slot * training_slots)
    Callbacks(trial.build_callbacks(), per_epoch)
    return DataFacts(len(train_set), len(val_set) if val_set is not None else None,  # type: ignore[arg-type]
                     per_epoch, config.max_length.to_batches(per_epoch))


def _dry_config(config: ExperimentConfig) -> ExperimentConfig:
    """The config rank 0 is built with here: the backend the run would pick for its slots on this machine;
    no profiler (nothing is timed); plain ``ddp`` where the strategy needs server ranks besides rank 0."""
    slots = config.resources.slots_per_trial
    update: dict[str, Any] = {"backend": ddist.resolve_backend(config.backend, slots, warn=False),
                              "profiling": config.profiling.model_copy(update={"enabled": False})}
    if registry.lookup(config.sync.strategy).has_server_ranks:
        update["sync"] = config.sync.model_copy(update={"strategy": "ddp"})
    # model_copy does not validate: every value here is one the schema accepts.
    return config.model_copy(update=update)


@contextlib.contextmanager
def _world_of_one(config: ExperimentConfig, context_class: type[TrialContext] = TrialContext) -> Iterator[TrialContext]:
    """A TrialContext over a one-rank process group, seeded as :func:`dtrain.engine.trainer.run_trial` seeds
    it; on leaving, the group is destroyed and the thread count and RNG states are as they were."""
    dry = _dry_config(config)
    threads = torch.get_num_threads()
    devices = list(range(torch.cuda.device_count())) if dry.backend == "nccl" else []
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            seed_everything(config.seed)
            yield context_class(dry)  # the trial's own context type, as run_trial builds it
    finally:
        # Not TrialContext.close(): its garbage collection and pause (a fifth of a second) let a DDP reducer
        # die before Gloo's threads are joined, and in a world of one every strategy leaves the models
        # unwrapped: no reducer, no collective in flight. The group goes even if the context failed after
        # making it.
        if tdist.is_initialized():
            tdist.destroy_process_group()
        torch.set_num_threads(threads)
        random.setstate(py_state)
        np.random.set_state(np_state)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "(no message)"


def _where(exc: BaseException, code_dir: str) -> str:
    """`` at FILE:LINE in FUNCTION``: the innermost frame in the trial's folder, else the innermost."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    root = Path(code_dir).resolve()
    own = [f for f in frames if Path(f.filename).resolve().is_relative_to(root)]
    frame = (own or frames)[-1]
    name = Path(frame.filename).name if own else frame.filename
    return f" at {name}:{frame.lineno} in {frame.name}"
