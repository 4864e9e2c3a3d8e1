"""Advice in the user's terms: what to check on a straggler's host, and what the machine can give.

The doctor (:mod:`dtrain.doctor`) decides *which* factor matters and how much; this module words the
fix so that a person can act on it: the rank, its host, how late it arrives and what to look at there
for the phase it is slow in.
"""

from __future__ import annotations

from typing import Any

# What slows one rank in each phase, and how to see it on that host (Linux tools that are always there
# first, then the GPU's).
CHECKS = {
    "data": ("its input pipeline: a slower or remote disk there (iostat -x 1, a network filesystem), a cold "
             "page cache, loader processes starved of CPU (top); more loader workers "
             "(data_loader.num_workers) overlap loading with the step"),
    "forward": ("other processes on its cores (top; ps -eo pcpu,comm --sort=-pcpu), CPU frequency or thermal "
                "throttling (grep MHz /proc/cpuinfo), more torch threads than cores (OMP_NUM_THREADS), on a GPU "
                "its clocks, temperature and other processes (nvidia-smi -q -d PERFORMANCE), and whether that "
                "rank gets bigger inputs (uneven lengths)"),
    "backward": ("gradient hooks or custom autograd functions doing extra work on that rank, other processes on "
                 "its cores (top), CPU frequency or thermal throttling (grep MHz /proc/cpuinfo), on a GPU its "
                 "clocks and temperature (nvidia-smi -q -d PERFORMANCE)"),
    "optimizer": ("memory pressure there (free -m; vmstat 1 shows swapping), other processes on its cores "
                  "(top), optimizer state on a slower device"),
    "other": ("work in train_batch that only that rank does (rank-conditional logging, metrics, printing) and "
              "other processes on its cores (top)"),
}


def straggler(profile: dict[str, Any], work: list[float]) -> dict[str, Any] | None:
    """The rank everyone waits for, from ``profile.json``'s arrival lags (``stragglers``), else from the
    per-rank work (older profiles). None with one slot."""
    ranks = profile["per_rank"]
    if len(ranks) < 2:
        return None
    lags = profile.get("stragglers") or {}
    per_rank = lags.get("per_rank") or []
    if per_rank:
        chronic = lags.get("chronic_rank")
        pick = chronic if chronic is not None else max(range(len(per_rank)),
                                                       key=lambda i: per_rank[i]["lag_median_seconds"])
        r = per_rank[pick]
        return {"rank": pick, "host": r.get("host") or "?", "lag_seconds": r["lag_median_seconds"],
                "lag_p90_seconds": r["lag_p90_seconds"], "last_fraction": r["last_fraction"],
                "samples": int(lags.get("samples", 0)), "chronic": chronic is not None,
                "phase": r["slow_phase"], "phase_excess_seconds": r["slow_phase_excess_seconds"], "measured": True}
    slowest = max(range(len(work)), key=lambda i: work[i])
    fastest = min(range(len(work)), key=lambda i: work[i])
    phases = ("data", "forward", "backward", "optimizer", "other")
    excess = {p: ranks[slowest]["seconds_per_step"][p] - min(r["seconds_per_step"][p] for r in ranks) for p in phases}
    phase = max(phases, key=lambda p: excess[p])
    return {"rank": slowest, "host": ranks[slowest].get("host") or "?", "lag_seconds": work[slowest] - work[fastest],
            "lag_p90_seconds": None, "last_fraction": None, "samples": 0, "chronic": None, "phase": phase,
            "phase_excess_seconds": excess[phase], "measured": False}


def straggler_text(s: dict[str, Any], leave_out: str) -> str:
    """One paragraph: who, where, how late, slow in what, what to check there, and the fallback."""
    ms = 1e3 * s["lag_seconds"]
    if s["measured"]:
        how = (f"arrives {ms:.2f} ms late at the gradient all-reduce (median over {s['samples']} sampled steps; "
               f"p90 {1e3 * s['lag_p90_seconds']:.2f} ms; last in {100 * s['last_fraction']:.0f}% of them)")
        if not s["chronic"]:
            how += ", though no rank is chronically last (ranks take turns: noise, or cores shared by all)"
    else:
        how = f"needs {ms:.2f} ms more work per step than the fastest rank"
    return (f"rank {s['rank']} (host {s['host']}) {how}, slow in {s['phase']} "
            f"(+{1e3 * s['phase_excess_seconds']:.2f} ms per step over the fastest rank); the other ranks wait for "
            f"it. Check on {s['host']}: {CHECKS[s['phase']]}. If it cannot be fixed, leave it out ({leave_out})")


def usable_cores(profile: dict[str, Any]) -> int | None:
    """CPU cores the run's host offered (recorded by the run), or None for older profiles."""
    cores = profile.get("cpu_cores")
    return int(cores) if cores else None


def loader_workers(profile: dict[str, Any]) -> int:
    """Background loader processes per slot to try: double the current count (at least 2), but no more
    than the cores each slot has, where the run recorded them (a loader process that finds no free core
    slows the training process it should hide behind)."""
    current = int(profile.get("data_loader_workers", 0))
    wanted = max(2, 2 * current)
    cores = usable_cores(profile)
    if cores is None:
        return wanted
    local_slots = max(1, int(profile["slots"]) // max(1, len({r.get("host") for r in profile["per_rank"]})))
    return max(1, min(wanted, cores // local_slots))
