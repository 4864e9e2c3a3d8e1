"""The run's own costs of finishing, as :mod:`dtrain.explain.goodput` needs them: what one checkpoint cost,
what a restart costs, how many batches are left, and the configured checkpoint period in batches.

All read from the run directory: ``profile.json`` (checkpoint and set-up seconds), ``summary.json`` (batches
and epochs trained) and ``config.yaml`` (``max_length``, ``min_checkpoint_period``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.explain.goodput import GoodputInputs, compare
from dtrain.profiling.record import ProfileRecord


@dataclass(frozen=True, slots=True)
class RunCosts:
    """Measured per-event costs of one run, and its length and checkpoint period in batches."""

    total_batches: int | None
    period_batches: int | None
    checkpoint_seconds: float  # one checkpoint
    restart_seconds: float  # set-up inside the workers plus reloading one checkpoint

    def inputs(self, step_seconds: float, slots: int, nodes: int, mttf_hours: float | None,
               price: float | None) -> GoodputInputs | None:
        """Goodput inputs for a configuration whose step is ``step_seconds``; None without a known length."""
        if not self.total_batches:
            return None
        return GoodputInputs(step_seconds=step_seconds, total_batches=self.total_batches,
                             checkpoint_seconds=self.checkpoint_seconds, restart_seconds=self.restart_seconds,
                             nodes=nodes, slots=slots, mttf_hours=mttf_hours, price_per_slot_hour=price,
                             checkpoint_period_batches=self.period_batches)


def _batches(length: Any, per_epoch: float | None) -> int | None:
    """A config length (``{batches: N}`` or ``{epochs: N}``) in batches."""
    if not isinstance(length, dict):
        return None
    if length.get("batches"):
        return int(length["batches"])
    if length.get("epochs") and per_epoch:
        return max(1, round(float(length["epochs"]) * per_epoch))
    return None


def run_costs(run_dir: Path, profile: ProfileRecord) -> RunCosts:
    """What ``run_dir`` measured; lengths it cannot read are None (then no time to finish is given)."""
    import yaml

    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        config = {}
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        trained, per_epoch = int(summary["batches"]), summary["batches"] / summary["epochs"]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        trained, per_epoch = profile.steps, None
    total = _batches(config.get("max_length"), per_epoch) if isinstance(config, dict) else None
    period = _batches(config.get("min_checkpoint_period"), per_epoch) if isinstance(config, dict) else None
    # One checkpoint per period and one at the end: the run's checkpoint time over that many.
    count = 1 + (max(0, trained - 1) // period if period else 0)
    one = profile.checkpoint_seconds / count
    setup = max(0.0, profile.wall_seconds - profile.train_seconds - profile.validation_seconds
                - profile.checkpoint_seconds)
    return RunCosts(total, period, one, setup + one)


def finish(costs: RunCosts, step_seconds: float, slots: int, nodes: int, mttf_hours: float | None,
           price: float | None) -> dict[str, Any] | None:
    """Time (and cost) to finish at ``step_seconds`` with expected failures, and the best checkpoint period."""
    inputs = costs.inputs(step_seconds, slots, nodes, mttf_hours, price)
    return compare(inputs).to_dict() if inputs is not None else None
