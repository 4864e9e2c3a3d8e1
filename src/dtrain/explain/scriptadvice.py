"""The doctor on a script's run: changes to try from outside, ``--try`` on a script, and what only a script shows.

A script run has no end-of-run probes (dtrain does not own its step), so no change of it gets a point figure:
each is "measure it with --verify", which runs the script again with it (:mod:`dtrain.explain.scriptverify`).
What the doctor names here: the changes dtrain can make without an edit
(:mod:`dtrain.profiling.script.overrides`), where the factors point at them; a change only an edit makes
(precision under autocast, the batch) with the script's line to change; and the findings of
:mod:`dtrain.profiling.script.findings`, each with its measured cost.
"""

from __future__ import annotations

import math
from typing import Any

from dtrain.explain.diagnosis import Diagnosis, TryResult
from dtrain.profiling.record import ProfileRecord
from dtrain.profiling.script import findings as script_findings
from dtrain.profiling.script import overrides

# A factor's change is named where the factor holds at least this share of the step (the doctor's own bar).
MIN_SHARE = 0.05
MEASURE = "a script run has no end-of-run probes (dtrain does not own its step): measure it with --verify"


def _share(diagnosis: Diagnosis, factor: str) -> float:
    row = diagnosis.factor(factor)
    return row.share if row is not None else 0.0


def suggestions(profile: ProfileRecord, diagnosis: Diagnosis) -> list[tuple[str, str]]:
    """(KEY=VALUE, why) for each change from outside the run's factors point at, biggest factor first."""
    s = profile.script
    if s is None:
        return []
    out: list[tuple[float, str, str]] = []
    data = _share(diagnosis, "data_loading")
    loader = s.loader
    if loader is not None and data >= MIN_SHARE:
        step = diagnosis.step_seconds
        wait = data * step
        if loader.num_workers == 0:  # enough processes to load a batch in the rest of a step, within the cores
            per_slot = max(1, profile.cpu_cores // max(1, profile.slots // max(1, profile.hosts)))
            need = math.ceil(wait / max(step - wait, 1e-3)) + 1
            workers = max(1, min(need, max(2, 2 * per_slot), 8))
            out.append((data, f"loader.num_workers={workers}", f"data loading is {100 * data:.0f}% of the step, "
                        "loaded in the training process (num_workers=0)"))
        elif profile.device == "cuda" and not loader.pin_memory:
            out.append((data, "loader.pin_memory=true", f"data loading is {100 * data:.0f}% of the step"))
    for f in script_findings.findings(profile):
        if f.verify and not any(item == f.verify for _, item, _ in out):
            out.append((1.0 if f.seconds is None else f.seconds / max(diagnosis.step_seconds, 1e-9), f.verify, f.seen))
    hooked = any(m.comm_hook for m in s.models)
    comm = _share(diagnosis, "communication")
    if s.models and profile.slots > 1 and comm >= MIN_SHARE and not hooked:
        out.append((comm, "ddp.comm_hook=fp16", f"the exposed all-reduce is {100 * comm:.0f}% of the step"))
    sync = _share(diagnosis, "sync_frequency")
    if s.models and profile.slots > 1 and sync >= MIN_SHARE:
        cap = profile.tensor_fusion_threshold_mb or 25.0
        out.append((sync, f"ddp.bucket_cap_mb={4 * cap:g}", f"per-message latency is {100 * sync:.0f}% of the step "
                    f"({profile.comm.buckets_per_step:g} all-reduces per step)"))
    out.sort(key=lambda t: t[0], reverse=True)
    return [(item, why) for _, item, why in out]


def attach(diagnosis: Diagnosis, profile: ProfileRecord) -> None:
    """A script run's findings and changes to try from outside, on its diagnosis (nothing for a Trial's run)."""
    if profile.script is None:
        return
    diagnosis.script_findings = script_findings.findings(profile)
    diagnosis.script_tries = suggestions(profile, diagnosis) if diagnosis.phases_observed else []


def text(diagnosis: Diagnosis) -> str:
    """The doctor's lines under its table for a script run: findings, then the changes to measure."""
    out = script_findings.render(diagnosis.script_findings)
    if diagnosis.script_tries:
        out += "try from outside (no edit of the script; measure with dtrain doctor RUN --verify):\n"
        out += "".join(f"  --try {item}: {why}\n" for item, why in diagnosis.script_tries)
    return out


def _edit_line(profile: ProfileRecord, key: str, value: Any) -> str:
    site_key, what = overrides.EDIT_ONLY[key]
    sites = profile.script.sites if profile.script is not None else {}
    where = sites.get(site_key)
    return (f"{key}={value} is made only by an edit of the script: {what}"
            + (f", at {where}" if where else " (the line was not recorded)"))


def try_one(profile: ProfileRecord, item: str) -> TryResult:
    """``--try KEY=VALUE`` on a script's run: no point figure (no probes), and why; :class:`UserError` for a
    key or value a script run does not take."""
    key, value = overrides.parse_item(item, edit_only=True)
    s = profile.script
    inputs = {"change": f"{key}: {value}"}
    if key in overrides.EDIT_ONLY:
        return TryResult(item, key, value, None, None, None, None, inputs, _edit_line(profile, key, value))
    why = MEASURE
    if key in ("slots", "nodes") and s is not None:
        if s.launcher == "DTRAIN_PROFILE":
            why = (f"the script starts its own processes ({s.launcher}), so it fixes the slot count: change it in "
                   "the script")
        elif key == "slots":
            per_slot = profile.per_slot_batch_size
            why = (f"{MEASURE}; the global batch changes with the slots ({per_slot} per slot: {per_slot * int(value)} "
                   f"instead of {profile.global_batch_size}), and so may the learning rate the script needs")
        else:
            why = "a short run here cannot add hosts: measure it with dtrain launch --nnodes on the hosts"
    hooks = [m.comm_hook for m in (s.models if s is not None else []) if m.comm_hook]
    if key == "ddp.comm_hook" and hooks:
        why = f"the script registers its own comm hook ({hooks[0]}): it is not replaced; change it in the script"
    if s is not None and not s.models and key.startswith("ddp."):
        why = "the script built no DistributedDataParallel model: nothing for this change to act on"
    return TryResult(item, key, value, None, None, None, None, inputs, why)


def refusal(result: TryResult) -> str | None:
    """Why ``--verify`` cannot run a tried change (None: it can)."""
    return result.reason if result.reason is not None and not result.reason.startswith(MEASURE) else None
