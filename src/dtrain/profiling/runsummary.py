"""``summary.json`` as a typed record: what a run was and how fast it went, written and read here only.

The end of a run builds a :class:`RunHead` (:func:`dtrain.profiling.figures.run_head`): the same facts open
``profile.json`` (:class:`dtrain.profiling.record.ProfileRecord`). ``summary.json`` is that head followed
by the run's totals (:class:`RunSummary`). The file's keys and order are those of the dict it used to be:
sections a run does not have (``unobserved_phases``, ``device_facts``, ``membership_changes``) are left out
rather than written as null. Readers use :func:`load_summary` and attributes, never string keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from pydantic import ValidationError

from dtrain.profiling.record import (
    DeviceFacts,
    FirstSteps,
    Flops,
    LrHyperparameter,
    MembershipChange,
    ProfileError,
    Section,
)

FILE_NAME = "summary.json"


class RunHead(Section):
    """What the run was and how fast it went: ``summary.json``'s head and ``profile.json``'s run facts.

    ``samples_per_second`` is the steady state over profiled steps when profiling (device-timed), else every
    step over the device-synchronized training time; both exclude validation and checkpoints."""

    OMITTED_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"unobserved_phases", "device_facts",
                                                             "membership_changes", "first_steps", "flops",
                                                             "exchange"})

    slots: int
    strategy: str
    backend: str
    device: str
    precision: str
    threads_per_slot: int
    cpu_cores: int
    memory_total_bytes: float
    # What a batch-size advice needs to keep training equivalent: the optimizer and its learning rate.
    optimizer: str | None
    lr_hyperparameter: LrHyperparameter | None
    global_batch_size: int
    per_slot_batch_size: int
    parameters: int
    synthetic_data: bool
    data_loader_workers: int
    aggregation_frequency: int
    effective_batch_size: int
    gradient_compression: str
    tensor_fusion_threshold_mb: float | None
    comm_measured: bool
    # How replicas talk (dtrain.sync.base.SyncStrategy.exchange); None: a file from before it was recorded.
    exchange: str | None = None
    # What the doctor may advise: the strategy's capabilities, from the registry's class.
    strategy_compressions: list[str]
    profiling: bool
    # The end-of-run probes ran (profiling.probes); False: the run turned them off, and no change is priced.
    probes: bool = True
    steps: int
    profiled_steps: int
    timed_steps: int
    samples_per_second: float
    samples_per_second_all_steps: float
    train_seconds: float
    validation_seconds: float
    checkpoint_seconds: float
    wall_seconds: float
    step_window_seconds: list[float] | None
    # train_batch calls loss.backward() / opt.step() itself: those phases are in "other".
    unobserved_phases: list[str] | None = None
    device_facts: DeviceFacts | None = None
    # A resumed run's figures cover its own part only.
    resumed_at_batch: int = 0
    # An elastic job's joins and leaves (dtrain.launcher.membership), absent where there were none.
    membership_changes: list[MembershipChange] | None = None
    # The first steps apart from the steady state (dtrain.profiling.warmup) and MFU (dtrain.profiling.flops).
    first_steps: FirstSteps | None = None
    flops: Flops | None = None


class RunSummary(RunHead):
    """The whole of ``summary.json``: the head, then the run's totals (``step_breakdown_seconds``: the first
    rank's per-step means by phase, empty when profiling was off; ``validation``: the last validation)."""

    batches: int
    epochs: float
    step_breakdown_seconds: dict[str, float]
    validation: dict[str, float]
    nonfinite_skipped_steps: int

    @classmethod
    def of(cls, head: RunHead, batches: int, epochs: float, step_breakdown_seconds: dict[str, float],
           validation: dict[str, float], nonfinite_skipped_steps: int) -> RunSummary:
        """The summary of a run whose head is ``head``, with its totals."""
        return cls.model_validate({**{name: getattr(head, name) for name in RunHead.model_fields},
                                   "batches": batches, "epochs": epochs,
                                   "step_breakdown_seconds": step_breakdown_seconds, "validation": validation,
                                   "nonfinite_skipped_steps": nonfinite_skipped_steps})

    def head(self) -> RunHead:
        """The head alone."""
        return RunHead.model_validate({name: getattr(self, name) for name in RunHead.model_fields})


def write_summary(path: Path, summary: RunSummary) -> None:
    """Write ``summary`` as ``summary.json`` (indented JSON, keys in the record's order)."""
    path.write_text(json.dumps(summary.model_dump(), indent=2))


def load_summary(path: Path) -> RunSummary:
    """Read and validate one ``summary.json``; anything else is a one-line :class:`ProfileError`."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path} does not exist; pass the directory of a finished run") from None
    except (OSError, ValueError) as exc:
        raise ProfileError(f"{path} cannot be read ({type(exc).__name__}); re-run the experiment") from None
    try:
        return RunSummary.model_validate(document)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "summary"
        raise ProfileError(f"{path} is damaged or from another dtrain ({where}: {err['msg']}); re-run the "
                           "experiment to write a new one") from None
