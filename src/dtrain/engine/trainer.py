"""The step loop: what a run does, in order, on every slot."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from dtrain.config.schema import ExperimentConfig
from dtrain.dist import all_hostnames
from dtrain.engine import data, schedulers
from dtrain.engine.callbacks import Callbacks
from dtrain.engine.context import TrialContext
from dtrain.engine.evaluation import Validation
from dtrain.engine.firstbatch import check_first_batch, warn_unread_hyperparameters
from dtrain.engine.metrics import (
    MeanAccumulator,
    MetricsWriter,
    SumInFlight,
    checked_metrics,
    means_of,
    membership_records,
    truncate_metrics,
)
from dtrain.engine.nonfinite import NonFiniteWatch
from dtrain.engine.progress import ProgressReporter
from dtrain.engine.runfacts import run_facts
from dtrain.engine.seeding import seed_everything
from dtrain.engine.stopping import StopVote, write_stopped
from dtrain.engine.survivor import keep_state
from dtrain.engine.trial import PyTorchTrial, load_trial_class
from dtrain.engine.watchdog import STATUS
from dtrain.profiling.clock import synchronized_now
from dtrain.profiling.figures import build_profile, collect_rank_figures, run_head
from dtrain.profiling.record import MembershipChange, write_profile
from dtrain.profiling.runsummary import RunSummary, write_summary
from dtrain.sync.base import Rebucketable, Serving
from dtrain.sync.fusion import tuner_for_run

log = logging.getLogger(__name__)


def run_trial(config: ExperimentConfig, run_dir: Path, resume_from: Path | None, quiet: bool) -> dict[str, Any]:
    """Build the trial on this slot, restore if asked, train to ``max_length``; returns the summary."""
    seed_everything(config.seed)  # identical initial weights on every slot (and DDP broadcasts rank 0's)
    trial_class = load_trial_class(config.entrypoint, config.code_dir)
    context = trial_class.context_class(config)  # TrialContext, or the trial's own subclass of it
    context.run_dir = run_dir
    trial = trial_class(context)
    summary = fit_trial(context, trial, config, run_dir, resume_from, quiet)
    # Not on failure: leaving the group would close this rank's connections before it wrote why it failed,
    # and its peers' "connection reset" would be reported instead (dtrain.engine.worker writes, then exits).
    del trial
    context.close()  # after the trial and its wrapped models are gone
    return summary


def fit_trial(context: TrialContext, trial: PyTorchTrial, config: ExperimentConfig, run_dir: Path,
              resume_from: Path | None, quiet: bool, validate_first: bool = False) -> dict[str, Any]:
    """Train a trial built on ``context`` (seeded alike on every slot) to ``config.max_length``, from
    ``resume_from`` if given (``validate_first``: a validation before training); returns the summary. The
    context stays open."""
    # Stochastic layers (dropout) must differ between slots, as they would between samples of one batch.
    seed_everything(config.seed + 7919 * context.rank)
    trainer = Trainer(context, trial, config, run_dir, quiet)
    if resume_from is not None:
        trainer.restore(resume_from)
    elif trainer.writer is not None:
        truncate_metrics(trainer.writer.path, 0)  # a run started over in place: its old records go
    if validate_first:
        trainer._validate()
    start_steps = context.optimizer_steps
    try:
        return trainer.fit()
    except Exception as exc:  # a lost peer: the survivors keep the last complete step
        keep_state(trainer, exc, start_steps)
        raise


def _next_boundary(period: int | None, after: int) -> int:
    """The first multiple of ``period`` above ``after`` (never, without a period)."""
    return (after // period + 1) * period if period else sys.maxsize


class _Report(NamedTuple):
    """A closed report window, this rank's figures (see :meth:`Trainer._report_training`)."""

    batches: int
    speed: float
    window: dict[str, float]
    names: list[str]  # the metrics summed over the ranks (average_training_metrics), else none
    values: list[Any]  # this rank's packed sums of those metrics (MeanAccumulator.packed)
    local: dict[str, float]  # the chief's own means (average_training_metrics off)


class _Sent(NamedTuple):
    """Reports whose one all-reduce, cast at batch ``cast_at``, is in flight: their sums, then the
    non-finite flag (on_nonfinite: fail), then the stop vote's flag and proposal (where reports carry it)."""

    cast_at: int
    reports: list[_Report]
    inflight: SumInFlight | None


# Reports held back for one all-reduce at most (a bound on its size where reports come very often).
MAX_HELD_REPORTS = 256


class Trainer:
    def __init__(self, context: TrialContext, trial: PyTorchTrial, config: ExperimentConfig, run_dir: Path,
                 quiet: bool) -> None:
        self.ctx, self.trial, self.config, self.run_dir = context, trial, config, run_dir
        self.per_slot = context.get_per_slot_batch_size()
        self.global_batch = context.get_global_batch_size()
        workers = config.data_loader.num_workers
        train_set = trial.build_training_data()
        # Loader processes live through the run: started again every epoch, each epoch's first batches waited
        # for their start-up and first load, which on short epochs cost more than they hid.
        self.loader = context.loader(train_set, self.per_slot, split="train",
                                     **{"num_workers": workers, "persistent_workers": workers > 0,
                                        **trial.loader_options("train")})
        self.sampler: data.ResumableDistributedSampler = self.loader.sampler  # type: ignore[assignment]
        self.validation = Validation(trial, context, trial.build_validation_data(), self.per_slot,
                                     {"num_workers": workers, **trial.loader_options("eval")})
        self.feeder = data.DeviceFeeder(context.device)
        self._fetch: Any = None  # the next batch, set when an epoch's iteration starts
        self.synthetic_batch: Any = None
        self.batches_per_epoch = data.batches_per_epoch(train_set, self.global_batch)
        self.total_batches = config.max_length.to_batches(self.batches_per_epoch)
        self.val_every = self._period(config.min_validation_period)
        self.ckpt_every = self._period(config.min_checkpoint_period)
        self.ckpt_root = run_dir / config.checkpoint_storage.path
        self.batches = 0
        self.resumed_at = 0  # the summary's figures cover batches resumed_at..batches (this process's part)
        self.resumed_from: Path | None = None
        self.train_metrics = MeanAccumulator()
        self.last_validation: dict[str, float] = {}
        self.validation_seconds = self.checkpoint_seconds = 0.0
        # Training time from device-synchronized points only (run start and end, reports): true on CUDA,
        # where host clocks around asynchronous kernels are not.
        self.train_seconds = 0.0
        self.steps = 0
        self._window_start, self._window_steps = 0.0, 0
        self._iterating = False
        self.tuner = tuner_for_run(context, config.optimizations, run_dir)
        # Non-finite losses: tracked on the device each step, compared across ranks where the loop syncs anyway.
        self.nonfinite = NonFiniteWatch(context.device, context.strategy.dp_group)
        self.fail_nonfinite = config.optimizations.on_nonfinite == "fail"
        self.nonfinite_skips = 0
        self._held: list[_Report] = []  # closed reports not sent yet (see _report_training)
        self._sent: _Sent | None = None  # reports whose all-reduce is in flight, read one step later
        self._carries_stop = False  # whether reports carry the stop vote (and may wait for it): set in fit
        self.vote: StopVote | None = None  # set when the loop starts (see dtrain.engine.stopping)
        # Step phases the trial's train_batch leaves unmarked (dtrain.engine.firstbatch), after its first batch.
        self.unobserved_phases: list[str] = []
        self._group_start = 0.0
        self.writer = MetricsWriter(run_dir) if context.is_chief else None
        self.progress = ProgressReporter(self.total_batches, 0, context.is_chief, quiet)
        self.callbacks = Callbacks(trial.build_callbacks(), self.batches_per_epoch)

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
        k, total = self.ctx.aggregation_frequency, self.total_batches
        # The next period boundaries: a batch only compares with them (this runs every step); they move on
        # when an exchange at or past them validates or checkpoints.
        next_val = _next_boundary(self.val_every, self.batches)
        next_ckpt = _next_boundary(self.ckpt_every, self.batches)
        for b in range(self.batches + 1, total + 1):
            sync = b % k == 0 or b == total
            validate = sync and b >= next_val
            ckpt = sync and b >= next_ckpt
            if validate:
                next_val = _next_boundary(self.val_every, b)
            if ckpt:
                next_ckpt = _next_boundary(self.ckpt_every, b)
            yield b, sync, validate, ckpt

    def fit(self) -> dict[str, Any]:
        if self.batches >= self.total_batches:  # resumed at the end: rewriting its results would lose them
            if self.ctx.is_chief:
                log.warning("the checkpoint is at batch %d, max_length is %d batches: nothing to train",
                            self.batches, self.total_batches)
            self.progress.close()
            return {"already_finished": self.batches}
        start = synchronized_now(self.ctx.device)
        strategy = self.ctx.strategy
        if strategy.has_server_ranks and strategy.is_server and isinstance(strategy, Serving):
            strategy.serve_run(self.ctx.optimizers[0], self.schedule(), self._checkpoint_at, self.batches)
            strategy.write_stats(self.run_dir)
            all_hostnames()  # the workers' end-of-run collective over every rank
            return {"role": "server", "wall_seconds": synchronized_now(self.ctx.device) - start}
        last_val = last_ckpt = -1
        # Where every rank agrees to stop on a signal (see dtrain.engine.stopping): an asynchronous all-reduce every
        # ~2 s, cast only where the training reports (which carry the flag too) come less often.
        vote = self.vote = StopVote(not strategy.has_server_ranks, self.batches, self.ctx.aggregation_frequency,
                                    self.ctx.backend)
        # Reports carry the vote only where their all-reduce spans every rank that votes (a parameter server's
        # workers' group does not, but its runs do not vote); only then, on several ranks, are they held back.
        self._carries_stop = vote.enabled and strategy.dp_group is None
        # Every batch exchanges gradients without aggregation: say so once, not through a context per step.
        every_batch_syncs = self.ctx.aggregation_frequency == 1
        if every_batch_syncs:
            self.ctx.gradient_sync(True)
        unit, total, tuner = self.config.scheduling_unit, self.total_batches, self.tuner
        step_end = self.callbacks.step_end
        # After a restore: the schedulers' own counts are where stepping resumes.
        lr_step = schedulers.stepper(self.ctx.lr_wrapped, self.batches_per_epoch, self.ctx.aggregation_frequency,
                                     self.ctx.is_chief)
        first = self.batches + 1
        self.callbacks.on_trial_startup(self.batches, str(self.resumed_from) if self.resumed_from else None)
        self.callbacks.on_training_start()
        self._open_window()
        for b, sync, validate, ckpt in self.schedule():
            if every_batch_syncs:
                self._train_step()
            else:
                with self.ctx.gradient_sync(sync):
                    self._train_step()
            if lr_step is not None:  # before this batch's checkpoint, which then holds the step
                lr_step(b, sync)
            if b == first:
                self.unobserved_phases = check_first_batch(self.ctx)
            if step_end is not None:  # only where a callback overrides a per-step hook
                step_end(b)
            if self._sent is not None:  # the previous batch's reports: their all-reduce had a step to finish
                self._read_sent()
            if sync and tuner is not None and tuner.active:
                self._tune_fusion()
            if b % unit == 0 or b == total:
                self._report_training()
            if validate or ckpt:
                strategy.refresh()
            if validate:
                self._validate()
                last_val = b
            if ckpt:
                self._checkpoint()
                last_ckpt = b
            if vote.due(b, sync) and b < total and vote.vote(b):
                return self._stop(last_ckpt)
        vote.settle()
        self._read_report()
        self._close_window()
        strategy.refresh()
        if self.validation.enabled and last_val != self.batches:
            self._validate()
        if last_ckpt != self.batches:
            self._checkpoint()  # a final checkpoint is always written
        self.callbacks.on_trial_shutdown()
        return self._finish(synchronized_now(self.ctx.device) - start)

    def _stop(self, last_ckpt: int) -> dict[str, Any]:
        """Every rank agreed to stop after this batch: checkpoint here, leave results for the finished run."""
        self._read_report()
        self._close_window()
        self.ctx.strategy.refresh()
        if last_ckpt != self.batches:
            self._checkpoint()
        self.callbacks.on_trial_shutdown()
        self.progress.close()
        if self.writer is not None:
            self.writer.close()
            write_stopped(self.run_dir / "logs", self.batches)
        return {"stopped_at": self.batches}

    def _train_step(self) -> None:
        epoch, position = divmod(self.batches, self.batches_per_epoch)
        timer = self.ctx.timer
        if position == 0 or not self._iterating:
            if position == 0:
                self.callbacks.on_training_epoch_start(epoch)
            # The step starts before the epoch's iterator does: starting it loads the first batch (and on
            # CUDA copies it), time this step waits for data.
            timer.start_step()
            STATUS.enter("loading data", self.batches)
            # Same seeded permutation on every slot; on resume, skip what was already trained.
            self.sampler.set_start(epoch, position * self.per_slot)
            if self.config.data_loader.synthetic:
                self._start_synthetic()
            else:
                self.feeder.start(iter(self.loader))
                self._fetch = self.feeder.fetcher()
            self._iterating = True
        else:
            timer.start_step()
            STATUS.enter("loading data", self.batches)
        batch = self._fetch()
        timer.data_lap()
        STATUS.enter("train_batch")
        metrics = self.trial.train_batch(batch, epoch, self.batches)
        timer.end_step()
        metrics = checked_metrics(metrics)  # once: the watch and the accumulator share it
        self.nonfinite.observe(metrics, self.batches)
        if self.ctx.nonfinite_skipped:  # on_nonfinite: skip; the update was not applied on any rank
            self.nonfinite_skips += 1
        else:
            self.train_metrics.add_checked(metrics)  # stays on the device until the next report
        self.batches += 1
        self._window_steps += 1
        if self.progress.has_bar:  # a terminal's bar; logs get the reports' lines only
            self.progress.advance(self.batches)

    def _start_synthetic(self) -> None:
        """``data_loader.synthetic``: one real batch (same shapes and dtypes), read once in this process
        and kept on the device; the loader is never iterated. An iterator every epoch, as for real data,
        started the loader's worker processes (``data_loader.num_workers``) every epoch, which loaded
        batches nobody read on the cores the slots train on and lived through the epoch (and, never
        drained, held each rank 5 s per worker at the end): the data-loading bisection of ``dtrain doctor
        --verify`` measured them rather than no loading."""
        if self.synthetic_batch is None:
            self.synthetic_batch = self.ctx.to_device(data.first_batch(self.loader))
        elif self.sampler.on_epoch_start is not None:  # what iterating the epoch would have announced
            self.sampler.on_epoch_start(self.sampler.epoch)
        self._fetch = self._synthetic_batch

    def _synthetic_batch(self) -> Any:
        return self.synthetic_batch

    def _tune_fusion(self) -> None:
        """Feed the auto-tuner each aggregation group's time (synchronized: tuning steps only)."""
        now = synchronized_now(self.ctx.device)
        seconds, self._group_start = now - self._group_start, now
        switch_to = self.tuner.after_step(seconds)  # type: ignore[union-attr]
        if switch_to is not None and isinstance(strategy := self.ctx.strategy, Rebucketable):
            for model in self.ctx.models:
                strategy.rebuild(model, switch_to)

    # ---------------------------------------------------------------------------- time windows
    def _open_window(self) -> None:
        self._window_start = synchronized_now(self.ctx.device)
        self._window_steps = 0
        self._group_start = self._window_start

    def _close_window(self) -> float:
        """Add the window since :meth:`_open_window` to the training time; its samples/s."""
        seconds = synchronized_now(self.ctx.device) - self._window_start
        self.train_seconds += seconds
        self.steps += self._window_steps
        return self._window_steps * self.global_batch / seconds if seconds > 0 else 0.0

    # ------------------------------------------------------------------------------ reporting
    def _report_training(self) -> None:
        """Close the report window; send the reports held so far in one all-reduce, or hold this one back.

        Sent reports are read, and written, a step later (:meth:`_read_sent`): a blocking all-reduce
        would hold every rank until the slowest arrived. Held back: where reports come more often than the
        stop vote's ~2 s (:mod:`dtrain.engine.stopping`), a report waits for the one after it, up to the last
        report before the vote falls due, which sends them all and carries the vote. Each all-reduce in
        flight slows the step it overlaps, and is most of a report's cost (bench/report_cost.py,
        docs/benchmarks.md). Held reports reach metrics.jsonl and TensorBoard at most ~2 s late;
        validation, checkpoints, a stop and the end send and write them first (:meth:`_read_report`)."""
        speed = self._close_window()
        averaged = self.config.optimizations.average_training_metrics
        names, values = self.train_metrics.packed() if averaged else ([], [])
        own = self.ctx.is_chief or self.callbacks.wants_reports  # their means, where they are not averaged
        local = self.train_metrics.local_means() if own and not averaged else {}
        self.train_metrics.reset()
        window = self.ctx.timer.take_window()  # on CUDA: the window's events are read back here
        self._held.append(_Report(self.batches, speed, window, names, values, local))
        self._open_window()
        vote = self.vote
        # Every rank decides alike: the schedule and the vote's next batch are the same on every rank.
        hold = (self._carries_stop and vote is not None and vote.world > 1 and len(self._held) < MAX_HELD_REPORTS
                and self.batches + self.config.scheduling_unit <= min(vote.next_at, self.total_batches))
        if not hold:
            self._send()

    def _send(self) -> None:
        """One all-reduce for the held reports, the non-finite flag and the stop vote (read by :meth:`_read_sent`)."""
        reports, self._held = self._held, []
        values = [v for report in reports for v in report.values]
        if self.fail_nonfinite:
            values.append(self.nonfinite.seen())
        if self._carries_stop and self.vote is not None:  # the stop vote rides along (dtrain.engine.stopping)
            values += self.vote.ride(self.batches)
        inflight = SumInFlight(values, self.ctx.strategy.dp_group) if values else None
        self._sent = _Sent(self.batches, reports, inflight)

    def _read_report(self, when: str = "at the report") -> None:
        """Send any held reports and write every report (fail first, saying ``when``, if a loss was
        non-finite); called before anything that must follow them: validation, checkpoints, a stop, the end."""
        self._read_sent(when)
        if self._held:
            self._send()
            self._read_sent(when)

    def _read_sent(self, when: str = "at the report") -> None:
        """Write the reports whose all-reduce is in flight (waiting for it, usually long done)."""
        sent, self._sent = self._sent, None
        if sent is None:
            return
        STATUS.enter("metric all-reduce", sent.cast_at - 1)
        summed = sent.inflight.wait() if sent.inflight is not None else []
        if self._carries_stop and self.vote is not None and sent.inflight is not None:
            proposals, flags = summed.pop(), summed.pop()
            self.vote.carried(sent.cast_at, flags, proposals, sent.inflight.world)
        if self.fail_nonfinite and summed.pop() > 0:  # some rank saw one: which, and where, costs one more
            self.nonfinite.fail_if_any(sent.cast_at, when)
        world = sent.inflight.world if sent.inflight is not None else 1
        at = 0
        for report in sent.reports:
            means = report.local
            if report.values:  # average_training_metrics: this report's slice of the sums
                means = means_of(report.names, summed[at:at + len(report.values)], world)
                at += len(report.values)
            if self.writer is not None:
                epoch = (report.batches - 1) // self.batches_per_epoch
                self.writer.write("training", report.batches, epoch, means, samples_per_second=report.speed)
                self.writer.scalars("time_ms", {k: 1000 * v for k, v in report.window.items()}, report.batches)
                self.progress.report("training", report.batches, epoch, means, report.speed)
            self.callbacks.on_training_report(report.batches, means)

    def _validate(self) -> None:
        self._read_report("before validation")  # the training record comes first
        if not self.validation.enabled:
            return
        STATUS.enter("validation")
        start = synchronized_now(self.ctx.device)
        self.callbacks.on_validation_start()
        self.last_validation = self.validation.run()
        self.callbacks.on_validation_end(self.last_validation)
        self._excluded(start, "validation_seconds")
        if self.writer is not None:
            epoch = (self.batches - 1) // self.batches_per_epoch
            self.writer.write("validation", self.batches, epoch, self.last_validation)
            self.progress.report("validation", self.batches, epoch, self.last_validation, None)

    def _excluded(self, start: float, total: str) -> None:
        """Charge the time since ``start`` to ``total`` and keep it out of the training window."""
        seconds = synchronized_now(self.ctx.device) - start
        setattr(self, total, getattr(self, total) + seconds)
        self._window_start += seconds
        self._group_start += seconds

    # --------------------------------------------------------------------------------- checkpoints
    def _checkpoint(self) -> None:
        self._read_report("before the checkpoint")  # written first: a resume from it does not redo its batches
        STATUS.enter("checkpoint")
        if self.fail_nonfinite and not self.ctx.strategy.is_server:
            self.nonfinite.fail_if_any(self.batches, "before the checkpoint")
        start = synchronized_now(self.ctx.device)
        # The epoch's length lets a later --resume tell, before any worker starts, whether a length in epochs
        # is already reached.
        extra = {"batches": self.batches, "batches_per_epoch": self.batches_per_epoch}
        rank_extra = {"train_metrics": self.train_metrics.state_dict()}
        self.callbacks.save_into(extra, rank_extra)
        path = self.ctx.save_checkpoint(self.ckpt_root, self.batches, extra=extra, rank_extra=rank_extra,
                                        keep_last=self.config.checkpoint_storage.save_trial_latest)
        self.callbacks.on_checkpoint_write_end(str(path))
        self._excluded(start, "checkpoint_seconds")

    def _checkpoint_at(self, batches: int) -> None:
        self.batches = batches
        self._checkpoint()

    def restore(self, path: Path) -> None:
        restored = self.ctx.training_state().restore(path)
        self.batches = int(restored.extra["batches"])
        self.resumed_at, self.resumed_from = self.batches, restored.path
        if restored.rank_extra is not None and "train_metrics" in restored.rank_extra:
            self.train_metrics.load_state_dict(restored.rank_extra["train_metrics"])
        self.callbacks.load_from(restored.extra, restored.rank_extra)
        if self.writer is not None:
            truncate_metrics(self.writer.path, self.batches)
        self.progress.advance(self.batches)
        if self.ctx.is_chief:
            log.info("resumed from %s at batch %d", restored.path, self.batches)

    # -------------------------------------------------------------------------------------- summary
    def _finish(self, wall_seconds: float) -> dict[str, Any]:
        STATUS.enter("end-of-run gather")
        self.progress.close()
        timer = self.ctx.timer
        warn_unread_hyperparameters(self.ctx)  # a collective: every rank's reads
        # An elastic job's joins and leaves (dtrain.launcher.membership), read where the files are written.
        changes = membership_records(self.run_dir) if self.writer is not None else []
        facts = run_facts(self, wall_seconds, [MembershipChange.model_validate(c) for c in changes])
        figures = collect_rank_figures(facts)  # collectives and probes
        head = run_head(facts, figures)
        summary = RunSummary.of(head, self.batches, self.batches / self.batches_per_epoch,
                                figures.per_rank[0] if timer.enabled else {}, self.last_validation,
                                self.nonfinite_skips)
        if self.writer is not None:
            self.writer.close()
            write_summary(self.run_dir / "summary.json", summary)
            if timer.enabled:
                write_profile(self.run_dir / "profile.json", build_profile(figures, head))
        return summary.model_dump()
