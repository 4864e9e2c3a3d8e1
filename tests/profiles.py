"""Profile records written by hand for the doctor, plan and report tests: a CPU run's facts by default,
the phases each test plants, and overrides for any top-level field (sections as dicts, validated).

Built through :class:`dtrain.profiling.record.ProfileRecord`, so a test's profile is one a real run could
write; :func:`write` puts it where ``dtrain run`` would (``RUN_DIR/profile.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtrain.profiling.phases import PHASES
from dtrain.profiling.record import ProfileRecord, write_profile
from dtrain.profiling.runsummary import RunHead, RunSummary

# A digits-like run on a 2-core VM; tests override what they are about.
FACTS: dict[str, Any] = {
    "strategy": "ddp", "backend": "gloo", "device": "cpu", "precision": "32-true", "threads_per_slot": 1,
    "cpu_cores": 2, "memory_total_bytes": 16 * 2**30, "optimizer": "SGD",
    "lr_hyperparameter": {"name": "lr", "value": 0.1}, "global_batch_size": 64, "parameters": 26122,
    "synthetic_data": False, "data_loader_workers": 0, "aggregation_frequency": 1, "gradient_compression": "none",
    "tensor_fusion_threshold_mb": 64.0, "comm_measured": True, "strategy_compressions": ["bf16", "fp16", "none"],
    "profiling": True, "steps": 660, "profiled_steps": 657, "timed_steps": 657, "samples_per_second": 34350.8,
    "samples_per_second_all_steps": 34029.5, "train_seconds": 1.24, "validation_seconds": 0.014,
    "checkpoint_seconds": 0.047, "wall_seconds": 1.35, "resumed_at_batch": 0,
    "device_facts": {"type": "cpu", "name": "cpu", "cores": 2, "total_memory_bytes": 16.0 * 2**30},
}
COMM = {"bytes_per_step": 0.0, "buckets_per_step": 0.0, "busy_seconds_per_step": 0.0,
        "exposed_seconds_per_step": 0.0, "algbw_bytes_per_second": 0.0, "busbw_bytes_per_second": 0.0,
        "latency_seconds": 0.0}


def make_profile(rank_seconds: list[dict[str, float]], hosts: str | list[str] = "vm", *,
                 comm: dict[str, float] | None = None, peak_memory_bytes: float = 1e8,
                 **overrides: Any) -> ProfileRecord:
    """A record whose ranks spend ``rank_seconds[i]`` (seconds per phase; ``step`` is their sum) per step,
    on ``hosts`` (one name for all, or one per rank); ``comm`` updates the zero ``comm`` section."""
    names = [hosts] * len(rank_seconds) if isinstance(hosts, str) else hosts
    ranks = []
    for i, phases in enumerate(rank_seconds):
        seconds = {p: float(phases.get(p, 0.0)) for p in PHASES}
        seconds["step"] = sum(seconds.values())
        ranks.append({"rank": i, "host": names[i], "seconds_per_step": seconds,
                      "comm_busy_seconds_per_step": seconds["comm_exposed"], "comm_bytes_per_step": 0.0,
                      "comm_buckets_per_step": 0.0, "peak_memory_bytes": float(peak_memory_bytes),
                      "state_bytes": 1e5})
    spread = {}
    for field in (*PHASES, "step"):
        values = [r["seconds_per_step"][field] for r in ranks]
        spread[field] = {"min": min(values), "mean": sum(values) / len(values), "max": max(values)}
    slots = overrides.pop("slots", len(ranks))
    gbs = overrides.get("global_batch_size", FACTS["global_batch_size"])
    document = {**FACTS, "slots": slots, "per_slot_batch_size": gbs // slots, "effective_batch_size": gbs,
                "phases": list(PHASES), "seconds_per_step": spread, "per_rank": ranks,
                "comm": {**COMM, **(comm or {})}, **overrides}
    return ProfileRecord.model_validate(document)


def write(run_dir: Path, record: ProfileRecord) -> Path:
    """``record`` as ``RUN_DIR/profile.json``; returns the file's path."""
    path = run_dir / "profile.json"
    write_profile(path, record)
    return path


def make_summary(validation: dict[str, float], **overrides: Any) -> RunSummary:
    """A ``summary.json`` record of the default run's facts (``overrides`` for any head field)."""
    slots = overrides.get("slots", 2)
    facts = {**FACTS, "slots": slots, "per_slot_batch_size": FACTS["global_batch_size"] // slots,
             "effective_batch_size": FACTS["global_batch_size"], "step_window_seconds": None, **overrides}
    head = RunHead.model_validate({k: v for k, v in facts.items() if k in RunHead.model_fields})
    return RunSummary.of(head, batches=facts["steps"], epochs=1.0, step_breakdown_seconds={}, validation=validation,
                         nonfinite_skipped_steps=0)
