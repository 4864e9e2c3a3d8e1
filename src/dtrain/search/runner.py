"""``dtrain search``: every trial a real ``dtrain run``, packed onto the machine's slots.

Layout of a search directory::

    experiment.yaml     the config searched (overrides applied): what --resume reads back
    study.journal       Optuna's journal: every trial's values, reports, ASHA rungs and state
    trials/<n>/         trial n: trial.yaml (its config, single values) and an ordinary run directory
    trials.json/.txt    the trials at the end; best.yaml, search.png, search.html beside them

A trial trains in *segments*, one ``dtrain run`` process each: to the end of its first rung, and, when
Optuna's successive halving promotes it, on from its checkpoint (``--resume``) to the next rung. Grid,
random and single trials have one segment, the full length. The journal is written as things happen, so
after Ctrl-C or a crash ``dtrain search --resume DIR`` keeps every finished trial and continues the
interrupted ones from their latest checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from dtrain.config.model import samples_only_sets
from dtrain.config.schema import ExperimentConfig
from dtrain.errors import UserError
from dtrain.search import procs
from dtrain.search.space import SearchPlan, load_plan, plan_from_raw
from dtrain.search.view import Progress, trial_rows, trials_table, write_outputs

STUDY = "dtrain-search"
CONFIG = "experiment.yaml"
POLL_SECONDS = 0.2


@dataclass
class Segment:
    """One ``dtrain run`` of trial ``number``, from its checkpoint (if any) to ``target``."""

    number: int
    target: int
    slots: tuple[int, ...]
    proc: subprocess.Popen
    log: Path


class Search:
    """Schedules the trials of one search directory until every trial is done (or an interruption)."""

    def __init__(self, plan: SearchPlan, out: Path, slots: int, gpus: bool) -> None:
        self.plan, self.out = plan, out
        per_trial = plan.config.resources.slots_per_trial
        self.pool = procs.SlotPool(slots, per_trial, gpus)
        fits = slots // per_trial
        self.concurrent = min(fits, plan.searcher.max_concurrent_trials or fits)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = JournalStorage(JournalFileBackend(str(out / "study.journal")))
        self.study = optuna.create_study(study_name=STUDY, storage=storage, direction=plan.direction,
                                         sampler=plan.sampler(0), pruner=plan.pruner(), load_if_exists=True)
        self.running: dict[int, Segment] = {}
        # Trials waiting for slots to continue (promoted by ASHA, or interrupted): they go before new trials.
        self.queue: deque[tuple[int, int]] = deque()
        self.kept = self._recover()

    # ------------------------------------------------------------------------------------------ start
    def _recover(self) -> int:
        """Queue the trials a previous invocation left running; return how many trials were already done."""
        done = 0
        for ft in self.study.get_trials(deepcopy=False):
            if ft.state != TrialState.RUNNING:
                done += 1
                continue
            last = max(ft.intermediate_values) if ft.intermediate_values else None
            if last is not None and last >= self.plan.lengths[-1]:  # reported in full, but never told
                self._tell(ft.number, ft.intermediate_values[last])
                done += 1
            else:
                self.queue.append((ft.number, self.plan.next_length(last, ft.number)))
        return done

    def _trial(self, number: int) -> optuna.trial.Trial:
        ft = self.study.get_trials(deepcopy=False)[number]
        return optuna.trial.Trial(self.study, ft._trial_id)  # Optuna's handle on a trial it already holds

    def _ask(self) -> int:
        number = len(self.study.get_trials(deepcopy=False))
        self.study.sampler = self.plan.sampler(number)
        trial = self.study.ask(self.plan.space.distributions())
        return trial.number

    def trial_dir(self, number: int) -> Path:
        return self.out / "trials" / str(number)

    def _start(self, number: int, target: int, slots: tuple[int, ...]) -> None:
        tdir = self.trial_dir(number)
        tdir.mkdir(parents=True, exist_ok=True)
        trial_yaml = tdir / "trial.yaml"
        if not trial_yaml.exists():  # written once, by rename: a crash never leaves half of it
            params = self.study.get_trials(deepcopy=False)[number].params
            tmp = tdir / ".trial.yaml.tmp"
            tmp.write_text(yaml.safe_dump(self.plan.trial_config(params), sort_keys=False))
            os.replace(tmp, trial_yaml)
        ckpt = tdir / self.plan.config.checkpoint_storage.path / "latest"
        resume = ckpt.is_file()
        if not resume and (tdir / "config.yaml").exists():  # died before its first checkpoint: start over
            for child in tdir.iterdir():
                if child.is_dir():
                    shutil.rmtree(child)
                elif child.name not in ("trial.yaml", "search.log"):
                    child.unlink()
        command = [sys.executable, "-m", "dtrain.cli", "run", str(trial_yaml.resolve()), "--run-dir",
                   str(tdir.resolve()), "--quiet", "--set", f"max_length={{{self.plan.unit}: {target}}}"]
        for item in samples_only_sets(self.plan.config):  # one trial of many, cut at its rungs
            command += ["--set", item]
        if resume:
            command += ["--resume", str(tdir.resolve())]
        log = tdir / "search.log"
        proc = procs.spawn(command, self.pool.env(slots), self.pool.cores_of(slots), log)
        self.running[number] = Segment(number, target, slots, proc, log)
        how = "continues from its checkpoint" if resume else "starts"
        self.progress.event(f"trial {number} {how} to {target} {self.plan.unit} on slot(s) "
                            f"{','.join(map(str, slots))}  ({self._params_text(number)})")

    def _params_text(self, number: int) -> str:
        params = self.study.get_trials(deepcopy=False)[number].params
        return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())

    # ------------------------------------------------------------------------------------------ finish
    def _finished(self, seg: Segment) -> None:
        self.pool.give(seg.slots)
        del self.running[seg.number]
        n, rc = seg.number, seg.proc.returncode
        if rc != 0:
            reason = procs.error_line(seg.log) or f"exited with code {rc}"
            if rc == 2:  # bad input: every other trial would fail the same way
                raise UserError(f"trial {n} ({self._params_text(n)}): {reason}; full output: {seg.log}")
            trial = self._trial(n)
            trial.set_user_attr("error", reason)
            self.study.tell(n, state=TrialState.FAIL)
            self.progress.event(f"trial {n} failed: {reason} (output: {seg.log})")
            return
        value, batches = self._result(n)
        trial = self._trial(n)
        trial.set_user_attr("batches", batches)
        trial.report(value, seg.target)
        shown = f"{self.plan.searcher.metric} {value:.4g} after {seg.target} {self.plan.unit}"
        if seg.target < self.plan.lengths[-1]:
            if trial.should_prune():  # Optuna's successive halving: not in the top 1/divisor of this rung
                self.study.tell(n, state=TrialState.PRUNED)
                self.progress.event(f"trial {n} stopped: {shown}")
            else:
                nxt = self.plan.next_length(seg.target, n)
                self.queue.appendleft((n, nxt))
                self.progress.event(f"trial {n} promoted to {nxt} {self.plan.unit}: {shown}")
            return
        self._tell(n, value)
        self.progress.event(f"trial {n} completed: {shown}")

    def _tell(self, number: int, value: float) -> None:
        if math.isfinite(value):
            self.study.tell(number, value)
        else:
            self._trial(number).set_user_attr("error", f"{self.plan.searcher.metric} is {value}")
            self.study.tell(number, state=TrialState.FAIL)

    def _result(self, number: int) -> tuple[float, int]:
        """The metric of the last validation of trial ``number`` and the batches it has trained."""
        tdir, metric = self.trial_dir(number), self.plan.searcher.metric
        records = [json.loads(ln) for ln in (tdir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        validations = [r for r in records if r.get("kind") == "validation"]
        if not validations:
            raise UserError(f"trial {number} reported no validation metrics, and searcher.metric {metric!r} must "
                            "be one: give the trial a build_validation_data()")
        last = validations[-1]["metrics"]
        if metric not in last:
            raise UserError(f"searcher.metric {metric!r} is not a validation metric of trial {number} "
                            f"(it reports {', '.join(sorted(last))}); set searcher.metric to one of those")
        value = last[metric]
        batches = json.loads((tdir / "summary.json").read_text())["batches"]
        return (float("nan") if value is None else float(value)), int(batches)

    # -------------------------------------------------------------------------------------------- loop
    def run(self, progress: Progress) -> None:
        """Start segments while slots are free; handle each one that ends; stop all of them on any exit."""
        self.progress = progress
        try:
            while True:
                self._fill()
                if not self.running:
                    break
                time.sleep(POLL_SECONDS)
                for seg in [s for s in self.running.values() if s.proc.poll() is not None]:
                    self._finished(seg)
                progress.update(self.rows, len(self.running), self.pool.total)
        finally:
            if self.running:  # Ctrl-C, a trial's bad input, or a bug: leave no trial process behind
                procs.stop([s.proc for s in self.running.values()])

    def _fill(self) -> None:
        while len(self.running) < self.concurrent:
            if self.queue:
                number, target = self.queue.popleft()
            elif len(self.study.get_trials(deepcopy=False)) < self.plan.max_trials:
                number = self._ask()
                target = self.plan.lengths_of(number)[0]
            else:
                return
            slots = self.pool.take()
            assert slots is not None  # concurrent <= total // per_trial
            self._start(number, target, slots)

    def rows(self) -> list[dict[str, Any]]:
        """Live rows: the study's, with running and queued trials labelled."""
        rows = trial_rows(self.study, self.plan, self.out)
        queued = dict(self.queue)
        for r in rows:
            n = r["trial"]
            if n in self.running:
                r["state"], r["note"] = "running", f"to {self.running[n].target} {self.plan.unit}"
            elif n in queued:
                r["state"], r["note"] = "queued", f"to {queued[n]} {self.plan.unit}"
        return rows


# ------------------------------------------------------------------------------------------- command


def machine_slots(config: ExperimentConfig) -> tuple[int, bool]:
    """(default slots, GPU slots?): the visible GPUs when the trials would use NCCL, else the CPU cores."""
    if config.backend == "gloo" or (config.backend == "auto" and not glob.glob("/dev/nvidia[0-9]*")):
        return len(procs.machine_cores()), False  # no GPU device node: torch would see none (and costs 2 s)
    from dtrain.dist import resolve_backend

    if resolve_backend(config.backend) == "nccl":
        import torch

        return torch.cuda.device_count(), True
    return len(procs.machine_cores()), False


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """One search process per directory; the lock dies with the process, so a crash never leaves it held."""
    with (out / "search.lock").open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(f"another dtrain search is running in {out}; wait for it or stop it first") from None
        yield


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """``kill`` (SIGTERM) stops a search as Ctrl-C does: trials stopped, the directory resumable."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def open_search(config: Path | None, out: Path | None, resume: Path | None,
                overrides: list[str]) -> tuple[SearchPlan, Path]:
    """Validate the command line and the config; make (or find) the search directory."""
    if resume is not None:
        if config is not None or out is not None or overrides:
            raise UserError("--resume SEARCH_DIR continues a search as it was started; drop CONFIG, --out and --set")
        stored = resume / CONFIG
        if not (resume / "study.journal").is_file() or not stored.is_file():
            raise UserError(f"--resume {resume}: not a search directory (no {CONFIG} and study.journal); pass a "
                            "folder made by dtrain search")
        raw = yaml.safe_load(stored.read_text())
        return plan_from_raw(raw, str(stored)), resume
    if config is None:
        raise UserError("dtrain search needs CONFIG (an experiment YAML with a searcher section), or --resume "
                        "SEARCH_DIR to continue one")
    plan = load_plan(config, overrides)
    out = out or Path("runs") / f"search-{plan.config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (out / CONFIG).exists():
        raise UserError(f"{out} already holds a search; continue it with dtrain search --resume {out}, or choose "
                        "another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG).write_text(yaml.safe_dump(plan.raw, sort_keys=False))
    except OSError as exc:
        raise UserError(f"cannot write search directory {out}: {exc.strerror or exc}; choose another --out") from None
    return plan, out


def run_search(config: Path | None, out: Path | None, resume: Path | None, slots: int | None,
               overrides: list[str]) -> dict[str, Any]:
    """``dtrain search``: run (or continue) a search to its end; returns what trials.json holds."""
    plan, out = open_search(config, out, resume, overrides)
    # A wrong entrypoint is not checked here (that costs a torch import): the first trial's dtrain run
    # refuses it before starting any worker, and that bad input stops the search with its one line.
    default, gpus = machine_slots(plan.config)
    slots = slots or default
    per_trial = plan.config.resources.slots_per_trial
    if slots < per_trial:
        raise UserError(f"--slots {slots} cannot hold one trial of resources.slots_per_trial {per_trial}; use "
                        f"--slots {per_trial} or more, or fewer slots per trial")
    if gpus and slots > default:
        raise UserError(f"--slots {slots} but {default} GPU(s) are visible; use --slots {default} or fewer")
    start = time.perf_counter()
    with _locked(out), _sigterm_as_interrupt():
        search = Search(plan, out, slots, gpus)
        lengths = plan.rungs_text()
        print(f"dtrain search: {plan.searcher.name}, {plan.max_trials} trial(s), {search.concurrent} at a time "
              f"on {slots} slot(s); {plan.searcher.metric} at {lengths} {plan.unit}; directory {out}", flush=True)
        for note in plan.notes:
            print(f"dtrain search: note: {note}", flush=True)
        for warning in plan.warnings:
            print(f"dtrain search: warning: {warning}", file=sys.stderr, flush=True)
        if resume is not None:
            print(f"dtrain search: resuming: {search.kept} finished trial(s) kept, {len(search.queue)} interrupted "
                  "trial(s) continue", flush=True)
        progress = Progress(plan)
        try:
            search.run(progress)
        except KeyboardInterrupt:
            progress.close()
            print(f"dtrain search: interrupted; continue with: dtrain search --resume {out}", file=sys.stderr,
                  flush=True)
            raise
        except UserError as exc:
            progress.close()
            raise UserError(f"{exc}; fix it in {out / CONFIG} and continue with: dtrain search --resume {out}, "
                            "or start a new search") from None
        progress.close()
        result = write_outputs(search.study, plan, out, time.perf_counter() - start)
    rows = trial_rows(search.study, plan, out)
    from dtrain.explain.render import as_text

    print(as_text(trials_table(rows, plan, f"dtrain search: {plan.searcher.name}, {len(rows)} trial(s)"),
                  width=160), end="")
    best = result["best"]
    if best is None:
        print("dtrain search: no trial completed; see the failures above")
    else:
        print(f"dtrain search: best trial {best['trial']}: {plan.searcher.metric} {best['value']:.4g}; "
              f"{result['total_batches']:,} batches trained in all; run it with: dtrain run {out / 'best.yaml'}")
    print(f"dtrain search: results in {out} (trials.json, trials.txt, best.yaml, search.png, search.html)")
    return result
