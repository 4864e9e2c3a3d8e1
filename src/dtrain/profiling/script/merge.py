"""A script's ranks' figures, as each rank leaves them (:func:`rank_payload`, plain JSON), made into the run's
``profile.json`` and ``summary.json`` (:func:`build_records`): the same records a Trial's run writes
(:func:`dtrain.profiling.figures.build_profile`), with a ``script`` section saying what ran and what could not
be seen. A script run has no end-of-run probes (dtrain does not own its step): ``probes`` is false, and what a
probe would have priced is left to ``dtrain doctor --verify``."""

from __future__ import annotations

import hashlib
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain.profiling import stragglers
from dtrain.profiling.device import cpu_cores, device_facts
from dtrain.profiling.figures import RANK_FIELDS, EndFigures, build_profile, peak_memory_bytes, state_bytes
from dtrain.profiling.figures import _memory_total as memory_total
from dtrain.profiling.record import (
    ALL_REDUCE,
    LrHyperparameter,
    ProfileRecord,
    ScriptLoader,
    ScriptModel,
    ScriptRun,
)
from dtrain.profiling.runsummary import RunHead, RunSummary
from dtrain.profiling.script.hooks import ScriptProfiler

# One line each: what a script run cannot show, whatever the script.
ALWAYS_UNSEEN = (
    "end-of-run probes: dtrain does not own the script's step, so a change they would price is measured with "
    "dtrain doctor --verify",
)
# Where they are counted (CUDA only: torch's sync debug mode), else one line.
NO_SYNC_COUNT = "host synchronizations per step (.item(), a CPU copy of the loss) are counted on CUDA only"
NO_DDP = ("no DistributedDataParallel model was built: gradient exchange (bytes, busy and exposed time) could not "
          "be seen; FSDP, an own all-reduce loop or one process are timed as data, forward, backward and optimizer")
NO_LOADER = "no batch came from a torch DataLoader while training: the data wait is in 'other'"


def script_sha256(path: Path) -> str:
    """The script's content hash (what ``--verify`` and ``compare`` hold two runs of "the same script" to)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""


def _ddp_facts(ddp: Any, cap_mb: float | None) -> dict[str, Any]:
    try:
        logged = ddp._get_ddp_logging_data()
    except (AttributeError, RuntimeError):
        logged = {}
    hook = logged.get("comm_hook") or None
    find_unused = bool(getattr(ddp, "find_unused_parameters", False))
    # The bytes of parameters DDP's reducer found unused in its last sampled iteration (only where it searched).
    unused = logged.get("unused_parameter_size") if find_unused else None
    return {"parameters": sum(p.numel() for p in ddp.module.parameters()), "bucket_cap_mb": cap_mb,
            "bucket_bytes_cap": int(getattr(ddp, "bucket_bytes_cap", 0)), "comm_hook": hook,
            "find_unused_parameters": find_unused,
            "unused_parameter_bytes": int(unused) if isinstance(unused, int) else None,
            "static_graph": bool(getattr(ddp, "static_graph", False)),
            "gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", False)),
            "broadcast_buffers": bool(getattr(ddp, "broadcast_buffers", False))}


def _lr(optimizers: list[Any]) -> float | None:
    for opt in optimizers:
        value = opt.param_groups[0].get("lr") if opt.param_groups else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value.item())
    return None


def rank_payload(prof: ScriptProfiler, rank: int, world: int, wall_seconds: float) -> dict[str, Any]:
    """This rank's figures and facts as plain JSON (written to its own file, and sent to rank 0 at the end)."""
    timer = prof.timer
    ddps = prof.live_ddps()
    optimizers = prof.live_optimizers()
    models = [d.module for d, _ in ddps]
    steps = timer.steps if timer is not None else 0
    per_step: dict[str, float] = {}
    lag: list[float] = []
    if timer is not None:
        timer.flush()  # the pending steps' figures (profiled_weight among them)
        last = timer.take_window()  # the steps since the last TensorBoard window
        if last and prof.phase_windows is not None:
            prof.phase_windows.append((timer.steps, last))
    if timer is not None and timer.profiled_weight > 0:
        timer.recorder.hold_native()
        per_step = timer.per_step()
        lag = timer.lag.export()
    exchanges = prof.exchanges / steps if steps else 0.0
    if exchanges > 0:  # DDP's figures are per exchange; a step holds this many (every micro-batch without no_sync)
        for key in ("comm_busy", "comm_bytes", "comm_buckets"):
            per_step[key] = per_step.get(key, 0.0) * exchanges
    params = ([p for m in models for p in m.parameters()] if models else
              list({id(p): p for o in optimizers for g in o.param_groups for p in g["params"]}.values()))
    device = prof.device or torch.device("cpu")
    figures = {**per_step, "peak_memory_bytes": peak_memory_bytes(device),
               "state_bytes": state_bytes(models, optimizers) if models else float(sum(
                   p.numel() * p.element_size() for p in params))}
    loader = prof.loader
    span = (prof.last_step_at - prof.first_step_at) if prof.first_step_at and prof.last_step_at else 0.0
    return {
        "rank": rank, "world": world, "host": socket.gethostname(),
        "figures": {f: float(figures.get(f, 0.0)) for f in RANK_FIELDS}, "lag": lag,
        "device": device.type, "backend": dist.get_backend() if dist.is_initialized() else "none",
        "threads": torch.get_num_threads(),
        "optimizers": list(prof.optimizer_names), "lr": prof.lr if prof.lr is not None else _lr(optimizers),
        "parameters": sum(p.numel() for p in params) or prof.parameters,
        "models": [_ddp_facts(d, cap) for d, cap in ddps],
        "gradient_bytes": [[p.numel() * p.element_size() for p in reversed(list(m.parameters())) if p.requires_grad]
                           for m in models],
        "loader": ({"batch_size": loader.batch_size, "num_workers": loader.num_workers,
                    "pin_memory": loader.pin_memory, "persistent_workers": loader.persistent_workers,
                    "prefetch_factor": loader.prefetch_factor, "iterators": loader.iterators,
                    "first_batch_seconds": loader.first_batch_seconds}
                   if loader.iterators else None),
        "steps": steps, "profiled_steps": timer.profiled_weight if timer is not None else 0,
        "timed_steps": timer.timed_steps if timer is not None else 0,
        "profiled_seconds": timer.profiled_seconds if timer is not None else 0.0,
        # Steps after the first: the first step's end is the span's start.
        "train_seconds": span, "span_steps": max(0, steps - 1),
        "validation_seconds": prof.validation_seconds, "wall_seconds": wall_seconds,
        "windows": list(timer.windows) if timer is not None else [],
        "phase_windows": prof.phase_windows,
        "micro_batches_per_step": prof.backwards / steps if steps else 0.0,
        "exchanges_per_step": exchanges, "no_sync": prof.no_sync, "grad_scaler": prof.grad_scaler,
        "disabled": not prof.on,
        "sites": {**prof.sites, **({"loader": loader.site} if loader.site else {})},
        "host_syncs_per_step": prof.host_syncs / steps if prof.counting_syncs and steps else None,
        "overrides": prof.overrides.spelled() if prof.overrides is not None else [],
        "refused": list(prof.refused),
        # Wall-clock times of this process's start and of this payload: a rank file of an earlier run in the same
        # directory ended before this run's first rank began.
        "began_at": time.time() - wall_seconds, "ended_at": time.time(),
    }


def _head(first: dict[str, Any], world: int, samples_per_second: float, all_steps: float) -> RunHead:
    ddp = bool(first["models"])
    loader = first["loader"] or {}
    per_slot = int(loader.get("batch_size") or 0)
    micro = max(1, round(first["micro_batches_per_step"] or 1))
    caps = {m["bucket_cap_mb"] for m in first["models"]}
    hooks = {str(m["comm_hook"] or "") for m in first["models"]}
    compression = ("fp16" if any("fp16" in h for h in hooks) else "bf16" if any("bf16" in h for h in hooks)
                   else "powersgd" if any("powersgd" in h.lower() for h in hooks) else "none")
    lr = first["lr"]
    device = torch.device(first["device"])
    return RunHead(
        slots=world, strategy="ddp" if ddp else "single" if world == 1 else "script", backend=first["backend"],
        device=first["device"], precision="16-mixed" if first["grad_scaler"] else "32-true",
        threads_per_slot=int(first["threads"]), cpu_cores=cpu_cores(), memory_total_bytes=memory_total(),
        optimizer=first["optimizers"][0] if first["optimizers"] else None,
        lr_hyperparameter=LrHyperparameter(name="lr", value=lr) if lr is not None else None,
        global_batch_size=per_slot * world, per_slot_batch_size=per_slot, parameters=int(first["parameters"]),
        synthetic_data=False, data_loader_workers=int(loader.get("num_workers", 0)),
        aggregation_frequency=micro, effective_batch_size=per_slot * world * micro,
        gradient_compression=compression,
        tensor_fusion_threshold_mb=next(iter(caps)) if len(caps) == 1 else None,
        comm_measured=ddp, exchange=ALL_REDUCE if ddp or world == 1 else None,
        strategy_compressions=["none"], profiling=True, probes=False,
        steps=int(first["steps"]), profiled_steps=int(first["profiled_steps"]),
        timed_steps=int(first["timed_steps"]), samples_per_second=samples_per_second,
        samples_per_second_all_steps=all_steps, train_seconds=float(first["train_seconds"]),
        validation_seconds=float(first["validation_seconds"]), checkpoint_seconds=0.0,
        wall_seconds=float(first["wall_seconds"]), step_window_seconds=first["windows"] or None,
        unobserved_phases=None if ddp or world == 1 else ["comm_exposed"],
        device_facts=device_facts(device) if device.type == "cpu" else None, resumed_at_batch=0)


def build_records(payloads: list[dict[str, Any]], info: dict[str, Any],
                  complete: bool) -> tuple[ProfileRecord | None, RunSummary | None, ScriptRun]:
    """The run's records from the ranks' payloads that exist (rank 0's facts head them; None without a profiled
    step); ``info``: the script's command, working directory, path and launcher."""
    payloads = sorted(payloads, key=lambda p: p["rank"])
    first = payloads[0]
    world = int(first["world"])
    unseen = list(ALWAYS_UNSEEN)
    if first.get("host_syncs_per_step") is None:
        unseen.append(NO_SYNC_COUNT)
    unseen += [f"not applied: {line}" for line in first.get("refused", [])]
    if not first["models"]:
        unseen.insert(0, NO_DDP)
    if first["loader"] is None:
        unseen.append(NO_LOADER)
    missing = sorted(set(range(world)) - {p["rank"] for p in payloads})
    if missing:
        unseen.append(f"rank(s) {', '.join(map(str, missing))} left no figures (a crash, or still running): the "
                      "per-rank figures and stragglers are of the others")
    if any(p["disabled"] for p in payloads):
        unseen.append("a hook failed on some rank and profiling stopped there (its log says where): figures end early")
    loader = first["loader"]
    script = ScriptRun(
        launcher=info["launcher"], command=list(info["command"]), cwd=info["cwd"], script=info["script"],
        script_sha256=script_sha256(Path(info["script"])), world_size=world,
        ranks_reported=[p["rank"] for p in payloads], complete=complete and not missing,
        models=[ScriptModel(**m) for m in first["models"]],
        loader=ScriptLoader(**loader) if loader is not None else None,
        micro_batches_per_step=float(first["micro_batches_per_step"]),
        exchanges_per_step=float(first["exchanges_per_step"]), no_sync=bool(first["no_sync"]),
        grad_scaler=bool(first["grad_scaler"]), optimizers=list(first["optimizers"]), unseen=unseen,
        host_syncs_per_step=first.get("host_syncs_per_step"), sites=dict(first.get("sites") or {}),
        overrides=list(first.get("overrides") or []))
    usable = [p for p in payloads if p["profiled_steps"] > 0 and p["lag"]]
    if not usable or first not in usable:
        return None, None, script
    per_rank = [dict(p["figures"]) for p in usable]
    if len(usable) > 1:
        for row, lag in zip(per_rank, stragglers.rank_figures([p["lag"] for p in usable]), strict=True):
            row.update(lag)
    loader_batch = int((loader or {}).get("batch_size") or 0)
    gbs = loader_batch * world
    steady = first["profiled_seconds"] / first["profiled_steps"]
    samples_per_second = gbs / steady if steady > 0 else 0.0
    all_steps = gbs * first["span_steps"] / first["train_seconds"] if first["train_seconds"] > 0 else 0.0
    head = _head(first, world, samples_per_second, all_steps)
    # The one-float all-reduce's latency, probed where every rank reached destroy_process_group() (else 0).
    figures = EndFigures(per_rank=per_rank, latency_seconds=float(first.get("latency_seconds", 0.0)),
                         hosts=[p["host"] for p in usable], comm_points=[],
                         gradient_bytes=first["gradient_bytes"] or None)
    # Its slots are the job's (the head's); its per-rank rows, the ranks that reported.
    record = build_profile(figures, head).model_copy(update={"script": script})
    breakdown = dict(record.per_rank[0].seconds_per_step.items())
    summary = RunSummary.of(head, batches=int(first["steps"]), epochs=float((loader or {}).get("iterators", 0)),
                            step_breakdown_seconds=breakdown, validation={}, nonfinite_skipped_steps=0)
    return record, summary, script
