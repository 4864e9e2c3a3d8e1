"""One-slot Trial runs of a trial written into a test's folder, in a process of their own with a hard
deadline, returning the warnings the run logged (for the engine's tests of first-batch checks and schedulers)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from helpers import run_ranks, tiny_config


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(rank: int, world: int, config: str, run_dir: str, resume: bool) -> list[str]:
    from dtrain.config.schema import load_config
    from dtrain.engine.trainer import run_trial

    collect = _Collect()
    logging.getLogger().addHandler(collect)
    run = Path(run_dir)
    (run / "logs").mkdir(parents=True, exist_ok=True)
    run_trial(load_config(Path(config)), run, run / "checkpoints" if resume else None, quiet=True)
    return collect.lines


def one_slot_run(folder: Path, source: str, entrypoint: str, run_dir: Path, resume: bool = False,
                 **overrides: Any) -> list[str]:
    """Write ``source`` as ``folder/<module>.py`` beside the tiny trial, train ``entrypoint`` on one slot
    into ``run_dir`` (resuming from its checkpoints if ``resume``); the warnings logged."""
    module = entrypoint.partition(":")[0]
    (folder / f"{module}.py").write_text(source)
    settings = {"entrypoint": entrypoint, "resources.slots_per_trial": 1, "hyperparameters.train_size": 64,
                "hyperparameters.val_size": 0, **overrides}
    config = tiny_config(folder, **settings)
    return run_ranks(_train, world_size=1, timeout=90, args=(str(config), str(run_dir), resume))[0]
