"""The step loop: what a run does, in order, on every slot."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtrain import data
from dtrain.config import ExperimentConfig
from dtrain.context import TrialContext
from dtrain.dist import all_hostnames
from dtrain.metrics import MeanAccumulator, MetricsWriter, truncate_metrics
from dtrain.profiler import build_profile, collect_rank_figures
from dtrain.progress import ProgressReporter
from dtrain.sync.fusion import tuner_for_run
from dtrain.trial import PyTorchTrial, load_trial_class

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def run_trial(config: ExperimentConfig, run_dir: Path, resume_from: Path | None, quiet: bool) -> dict[str, Any]:
    """Build the trial on this slot, restore if asked, train to ``max_length``; returns the summary."""
    seed_everything(config.seed)  # identical initial weights on every slot (and DDP broadcasts rank 0's)
    context = TrialContext(config)
    try:
        return _train(context, config, run_dir, resume_from, quiet)
    finally:
        context.close()  # after _train returned: the trial and its wrapped models are gone by then


def _train(context: TrialContext, config: ExperimentConfig, run_dir: Path, resume_from: Path | None,
           quiet: bool) -> dict[str, Any]:
    trial = load_trial_class(config.entrypoint, config.code_dir)(context)
    # Stochastic layers (dropout) must differ between slots, as they would between samples of one batch.
    seed_everything(config.seed + 7919 * context.rank)
    trainer = Trainer(context, trial, config, run_dir, quiet)
    if resume_from is not None:
        trainer.restore(resume_from)
    return trainer.fit()


def _crossed(period: int | None, previous: int, now: int) -> bool:
    """A multiple of ``period`` lies in (previous, now]."""
    return bool(period) and now // period > previous // period  # type: ignore[operator]


class Trainer:
    def __init__(self, context: TrialContext, trial: PyTorchTrial, config: ExperimentConfig, run_dir: Path,
                 quiet: bool) -> None:
        self.ctx, self.trial, self.config, self.run_dir = context, trial, config, run_dir
        self.per_slot = context.get_per_slot_batch_size()
        self.global_batch = context.get_global_batch_size()
        workers = config.data_loader.num_workers
        train_set = trial.build_training_data()
        dp_rank, dp_world = context.strategy.dp_rank, context.strategy.dp_world
        self.loader, self.sampler = data.train_loader(train_set, self.per_slot, dp_rank, dp_world, config.seed,
                                                      workers)
        val_set = trial.build_validation_data()
        self.val_loader = (data.eval_loader(val_set, self.per_slot, dp_rank, dp_world, workers)
                           if val_set is not None else None)
        self.synthetic_batch: Any = None
        self.batches_per_epoch = data.batches_per_epoch(train_set, self.global_batch)
        self.total_batches = config.max_length.to_batches(self.batches_per_epoch)
        self.val_every = self._period(config.min_validation_period)
        self.ckpt_every = self._period(config.min_checkpoint_period)
        self.ckpt_root = run_dir / config.checkpoint_storage.path
        self.batches = 0
        self.train_metrics = MeanAccumulator()
        self.last_validation: dict[str, float] = {}
        self.validation_seconds = self.checkpoint_seconds = 0.0
        self._iterator: Any = None
        self.tuner = tuner_for_run(context, config.optimizations, run_dir)
        self._group_seconds = self._group_start = 0.0
        self.writer = MetricsWriter(run_dir) if context.is_chief else None
        self.progress = ProgressReporter(self.total_batches, 0, context.is_chief, quiet)

    def _period(self, length: Any) -> int | None:
        return length.to_batches(self.batches_per_epoch) if length is not None else None

    # ---------------------------------------------------------------------------------------- loop
    def schedule(self) -> Iterator[tuple[int, bool, bool, bool]]:
        """(batches after this step, exchange gradients?, validate?, checkpoint?) for every remaining batch.

        Gradients are exchanged on the last batch of each aggregation group and on the very last batch;
        validation and checkpoints only happen there (mid-group, weights have not changed and accumulated
        gradients are not saved), when a period boundary was crossed since the previous exchange.
        Every rank derives the same schedule, so a parameter server's servers keep step with the workers.
        """
        k = self.ctx.aggregation_frequency
        previous = self.batches
        for b in range(self.batches + 1, self.total_batches + 1):
            sync = b % k == 0 or b == self.total_batches
            validate = sync and _crossed(self.val_every, previous, b)
            ckpt = sync and _crossed(self.ckpt_every, previous, b)
            previous = b if sync else previous
            yield b, sync, validate, ckpt

    def fit(self) -> dict[str, Any]:
        start = time.perf_counter()
        if self.ctx.strategy.is_server:
            return self._serve(start)
        last_val = last_ckpt = -1
        for b, sync, validate, ckpt in self.schedule():
            with self.ctx.gradient_sync(sync):
                self._train_step()
            if b % self.config.scheduling_unit == 0 or b == self.total_batches:
                self._report_training()
            if sync:
                self._tune_fusion()
            if validate or ckpt:
                self.ctx.strategy.refresh()
            if validate:
                self._validate()
                last_val = b
            if ckpt:
                self._checkpoint()
                last_ckpt = b
        self.ctx.strategy.refresh()
        if self.val_loader is not None and last_val != self.batches:
            self._validate()
        if last_ckpt != self.batches:
            self._checkpoint()  # a final checkpoint is always written
        return self._finish(time.perf_counter() - start)

    def _serve(self, start: float) -> dict[str, Any]:
        """A parameter server's server rank: apply the workers' gradients, join their checkpoints."""
        strategy, optimizer = self.ctx.strategy, self.ctx.optimizers[0]
        updates = strategy.stats.updates  # type: ignore[attr-defined]
        last_ckpt = -1
        for b, sync, validate, ckpt in self.schedule():
            updates += sync
            if validate or ckpt:
                strategy.serve(optimizer, updates, workers_pull=True)  # type: ignore[attr-defined]
            self.batches = b
            if ckpt:
                self._checkpoint()
                last_ckpt = b
        strategy.serve(optimizer, updates, workers_pull=True)  # type: ignore[attr-defined]
        if last_ckpt != self.batches:
            self._checkpoint()
        strategy.write_stats(self.run_dir)  # type: ignore[attr-defined]
        all_hostnames()  # the workers' end-of-run collective over every rank
        return {"role": "server", "wall_seconds": time.perf_counter() - start}

    def _tune_fusion(self) -> None:
        if self.tuner is None:
            return
        self._group_seconds += self.ctx.timer.step_seconds - self._group_start
        self._group_start = self.ctx.timer.step_seconds
        switch_to = self.tuner.after_step(self._group_seconds)
        self._group_seconds = 0.0
        if switch_to is not None:
            for model in self.ctx.models:
                self.ctx.strategy.rebuild(model, switch_to)

    def _train_step(self) -> None:
        epoch, position = divmod(self.batches, self.batches_per_epoch)
        if position == 0 or self._iterator is None:
            # Same seeded permutation on every slot; on resume, skip what was already trained.
            self.sampler.set_start(epoch, position * self.per_slot)
            self._iterator = iter(self.loader)
        timer = self.ctx.timer
        timer.start_step()
        batch = self._next_batch()
        timer.lap("data")
        metrics = self.trial.train_batch(batch, epoch, self.batches)
        timer.end_step()
        self.train_metrics.add(metrics)
        self.batches += 1
        self.progress.advance(self.batches)

    def _next_batch(self) -> Any:
        if not self.config.data_loader.synthetic:
            return self.ctx.to_device(next(self._iterator))
        if self.synthetic_batch is None:  # one real batch, same shapes and dtypes, kept on the device
            self.synthetic_batch = self.ctx.to_device(next(self._iterator))
        return self.synthetic_batch

    def _report_training(self) -> None:
        if self.config.optimizations.average_training_metrics:
            means = self.train_metrics.global_means(self.ctx.strategy.dp_group)  # collective over training slots
        elif self.ctx.is_chief:
            means = self.train_metrics.local_means()  # chief's own, no communication
        else:
            means = {}
        self.train_metrics.reset()
        if self.writer is not None:
            speed = self.samples_per_second()
            epoch = (self.batches - 1) // self.batches_per_epoch
            self.writer.write("training", self.batches, epoch, means, samples_per_second=speed)
            self.writer.scalars("time_ms", {k: 1000 * v for k, v in self.ctx.timer.take_window().items()},
                                self.batches)
            self.progress.report("training", self.batches, epoch, means, speed)

    def _validate(self) -> None:
        if self.val_loader is None:
            return
        start = time.perf_counter()
        for model in self.ctx.models:
            model.eval()
        acc = MeanAccumulator()
        with torch.no_grad():
            for i, batch in enumerate(self.val_loader):
                metrics = self.trial.evaluate_batch(self.ctx.to_device(batch), i)
                acc.add(metrics, weight=data.batch_size_of(batch))  # exact: sums over records, not mean of means
        for model in self.ctx.models:
            model.train()
        self.last_validation = acc.global_means(self.ctx.strategy.dp_group)
        self.validation_seconds += time.perf_counter() - start
        if self.writer is not None:
            epoch = (self.batches - 1) // self.batches_per_epoch
            self.writer.write("validation", self.batches, epoch, self.last_validation)
            self.progress.report("validation", self.batches, epoch, self.last_validation, None)

    # --------------------------------------------------------------------------------- checkpoints
    def _checkpoint(self) -> None:
        start = time.perf_counter()
        self.ctx.save_checkpoint(
            self.ckpt_root, self.batches, extra={"batches": self.batches},
            keep_last=self.config.checkpoint_storage.save_trial_latest,
            rank_extra={"train_metrics": self.train_metrics.state_dict()},
        )
        self.checkpoint_seconds += time.perf_counter() - start

    def restore(self, path: Path) -> None:
        loaded = self.ctx.restore(path)
        self.batches = int(loaded.trainer_state["extra"]["batches"])
        if loaded.rank_state is not None and loaded.metadata.get("world_size") == self.ctx.world_size:
            self.train_metrics.load_state_dict(loaded.rank_state["extra"]["train_metrics"])
        if self.writer is not None:
            truncate_metrics(self.writer.path, self.batches)
        self.progress.advance(self.batches)
        if self.ctx.is_chief:
            log.info("resumed from %s at batch %d", loaded.path, self.batches)

    # -------------------------------------------------------------------------------------- summary
    def samples_per_second(self) -> float:
        seconds = self.ctx.timer.step_seconds
        return self.ctx.timer.steps * self.global_batch / seconds if seconds else 0.0

    def _finish(self, wall_seconds: float) -> dict[str, Any]:
        self.progress.close()
        timer = self.ctx.timer
        per_rank, latency, hosts = collect_rank_figures(self.ctx)  # collectives
        steady = timer.profiled_steps * self.global_batch / timer.profiled_seconds if timer.profiled_seconds else 0.0
        run = {
            "slots": self.ctx.strategy.dp_world,
            "strategy": self.ctx.strategy.name,
            "backend": self.ctx.backend,
            "device": self.ctx.device.type,
            "threads_per_slot": self.ctx.num_threads,
            "global_batch_size": self.global_batch,
            "per_slot_batch_size": self.per_slot,
            "parameters": sum(p.numel() for m in self.ctx.models for p in m.parameters()),
            "synthetic_data": self.config.data_loader.synthetic,
            "data_loader_workers": self.config.data_loader.num_workers,
            "aggregation_frequency": self.config.optimizations.aggregation_frequency,
            "effective_batch_size": self.global_batch * self.config.optimizations.aggregation_frequency,
            "gradient_compression": self.config.optimizations.gradient_compression,
            "tensor_fusion_threshold_mb": getattr(self.ctx.strategy, "bucket_cap_mb", None),
            "profiling": timer.enabled,
            "steps": timer.steps,
            "profiled_steps": timer.profiled_steps,
            "samples_per_second": steady if timer.enabled else self.samples_per_second(),
            "samples_per_second_all_steps": self.samples_per_second(),
            "train_seconds": timer.step_seconds,
            "validation_seconds": self.validation_seconds,
            "checkpoint_seconds": self.checkpoint_seconds,
            "wall_seconds": wall_seconds,
        }
        profile = build_profile(per_rank, hosts, run, latency)
        summary = {**run, "batches": self.batches, "epochs": self.batches / self.batches_per_epoch,
                   "step_breakdown_seconds": per_rank[0] if timer.enabled else {},
                   "validation": self.last_validation}
        if self.writer is not None:
            self.writer.close()
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            if timer.enabled:
                (self.run_dir / "profile.json").write_text(json.dumps(profile, indent=2))
        return summary
