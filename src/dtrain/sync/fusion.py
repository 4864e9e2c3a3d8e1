"""Auto-tuning the tensor-fusion threshold (DDP bucket size) on the real model, during training.

Horovod tunes fusion with Bayesian optimisation over many knobs. Here there is one knob with a handful
of sensible values, so a measured, bounded sweep finds the best for certain: each candidate runs for a
few warm-up steps and then a few measured steps of the real training (so tuning costs no extra steps,
only the steps that run at worse settings), every rank's times are compared on the slowest rank, and the
fastest candidate is kept for the rest of the run, written to ``RUN_DIR/fusion_tuning.json`` and reused on
resume.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from dtrain import dist as ddist

if TYPE_CHECKING:
    from dtrain.sync.base import SyncStrategy
    from dtrain.sync.options import OptimizationsView

log = logging.getLogger(__name__)
RESULT_FILE = "fusion_tuning.json"


def candidate_plan(candidates_mb: list[float], gradient_bytes: int, current_mb: float) -> list[float]:
    """Distinct candidates, smallest first; every size that holds all gradients in one bucket is the same
    layout, so only the smallest of those is kept."""
    total_mb = gradient_bytes / 2**20
    plan: list[float] = []
    for mb in sorted({*candidates_mb, current_mb}):
        if plan and plan[-1] >= total_mb:
            break
        plan.append(mb)
    return plan


class FusionTuner:
    """Feed it the time of every synchronizing step; it says when to switch bucket size."""

    def __init__(self, plan: list[float], warmup_steps: int, measured_steps: int, run_dir: Path,
                 is_chief: bool) -> None:
        self.plan = plan
        self.warmup_steps = warmup_steps
        self.measured_steps = measured_steps
        self.run_dir = run_dir
        self.is_chief = is_chief
        self.index = 0
        self.seen = 0
        self.times: dict[float, list[float]] = {mb: [] for mb in plan}
        self.all_seconds = 0.0
        self.all_steps = 0
        self.choice: float | None = None

    @property
    def current(self) -> float:
        return self.plan[self.index]

    @property
    def active(self) -> bool:
        return self.choice is None

    def after_step(self, seconds: float) -> float | None:
        """Record one step; return a bucket size to switch to now, or None."""
        if not self.active:
            return None
        self.all_seconds += seconds
        self.all_steps += 1
        if self.seen >= self.warmup_steps:
            self.times[self.current].append(seconds)
        self.seen += 1
        if self.seen < self.warmup_steps + self.measured_steps:
            return None
        log.info("fusion auto-tune: %.1f MB buckets: median step %.3f ms", self.current,
                 1e3 * statistics.median(self.times[self.current]))
        if self.index + 1 < len(self.plan):
            self.index += 1
            self.seen = 0
            return self.current
        self.choice = self._decide()
        return self.choice

    def _decide(self) -> float:
        # Every rank must pick the same size: compare each candidate's slowest-rank median.
        medians = torch.tensor([statistics.median(self.times[mb]) for mb in self.plan], dtype=torch.float64)
        if ddist.is_distributed():
            if dist.get_backend() == "nccl":
                medians = medians.cuda()
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)
        medians = medians.cpu()
        best = int(torch.argmin(medians))
        best_seconds = float(medians[best])
        cost = self.all_seconds - self.all_steps * best_seconds
        result = {
            "chosen_mb": self.plan[best],
            "trials": [{"bucket_mb": mb, "median_step_seconds": float(medians[i]),
                        "steps": self.warmup_steps + self.measured_steps} for i, mb in enumerate(self.plan)],
            "tuning_steps": self.all_steps,
            "tuning_seconds": self.all_seconds,
            "tuning_cost_seconds": cost,
            "cost_vs_1000_steps": cost / (1000 * best_seconds) if best_seconds > 0 else 0.0,
        }
        log.info("fusion auto-tune: chose %.1f MB (%.3f ms/step); tuning cost %.3f s = %.2f%% of a 1000-step run",
                 self.plan[best], 1e3 * best_seconds, cost, 100 * result["cost_vs_1000_steps"])
        if self.is_chief:
            (self.run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
        return self.plan[best]


def saved_choice(run_dir: Path) -> float | None:
    """The bucket size an earlier attempt of this run chose, if any (reused on resume)."""
    path = run_dir / RESULT_FILE
    if not path.is_file():
        return None
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return float(data["chosen_mb"])
    except (ValueError, KeyError, TypeError):
        return None


class TuningHost(Protocol):
    """What the tuner needs of the engine's context (:class:`dtrain.engine.context.DistributedContext`)."""

    @property
    def strategy(self) -> SyncStrategy: ...
    @property
    def models(self) -> Sequence[nn.Module]: ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_chief(self) -> bool: ...


def tuner_for_run(ctx: TuningHost, options: OptimizationsView, run_dir: Path) -> FusionTuner | None:
    """The tuner for this run (None when not auto-tuning, or when an earlier attempt already chose: then
    the models are re-bucketed to that choice here)."""
    from dtrain.sync.base import Rebucketable

    strategy = ctx.strategy
    if not (options.auto_tune_tensor_fusion and ctx.world_size > 1 and isinstance(strategy, Rebucketable)):
        return None
    chosen = saved_choice(run_dir)
    if chosen is not None:
        for model in ctx.models:
            strategy.rebuild(model, chosen)
        log.info("fusion auto-tune: reusing %.1f MB from %s", chosen, run_dir / RESULT_FILE)
        return None
    grad_bytes = sum(p.numel() * p.element_size() for m in ctx.models for p in m.parameters() if p.requires_grad)
    plan = candidate_plan(options.auto_tune_candidates_mb, grad_bytes, options.tensor_fusion_threshold)
    tuner = FusionTuner(plan, options.auto_tune_warmup_steps, options.auto_tune_steps_per_candidate, run_dir,
                        ctx.is_chief)
    for model in ctx.models:
        strategy.rebuild(model, tuner.current)
    return tuner
