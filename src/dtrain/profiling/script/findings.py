"""What only a script shows (issue 72, part 5): each finding with what was seen, its measured cost and the line
to change, from a script run's ``profile.json`` alone (no cost model: the figures are the run's own).

* an all-reduce on every micro-batch of an accumulation (no ``no_sync``): the exposed exchange of all but one
  micro-batch per step;
* ``find_unused_parameters=True`` on a model that used every parameter (DDP's reducer found none unused in its
  last sampled iteration): a traversal of the autograd graph after every forward, inside the forward phase;
* a host synchronization every step on CUDA (``.item()``, a CPU copy of the loss), counted through torch's sync
  debug mode;
* the loader's worker processes started again every epoch: the first batch of each epoch after the first,
  over a step's usual wait for its batch.

Costs a run cannot separate (the graph traversal inside forward, a sync's wait) are said to be so, with the
``--try`` that measures them, never guessed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dtrain.profiling.record import ProfileRecord


@dataclass(frozen=True)
class Finding:
    """One thing the script does that costs time: what was seen, its cost, and the fix."""

    name: str  # "no_sync", "find_unused_parameters", "host_syncs", "loader_restarts"
    seen: str
    cost: str  # the cost in words (measured, or why it could not be separated)
    seconds: float | None  # the measured cost, per ``per``; None where the run cannot separate it
    per: str  # "step" or "epoch"
    fix: str  # the line to change, and how
    verify: str | None = None  # a --try that measures the fix from outside (None: only an edit makes it)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _at(sites: dict[str, str], key: str, what: str) -> str:
    site = sites.get(key)
    return f"{what} at {site}" if site and site != "?" else what


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"


def _no_sync(p: ProfileRecord) -> Finding | None:
    s = p.script
    if s is None or not s.models or p.slots < 2 or s.micro_batches_per_step < 1.5 or s.exchanges_per_step < 1.5:
        return None
    micro, exchanges = s.micro_batches_per_step, s.exchanges_per_step
    exposed, busy = p.comm.exposed_seconds_per_step, p.comm.busy_seconds_per_step
    extra = (exchanges - 1) / exchanges  # every exchange but the step's last is one no_sync would skip
    return Finding(
        "no_sync", f"{micro:g} micro-batches per optimizer step, each all-reducing its gradients "
                   f"({exchanges:g} exchanges per step; DDP's no_sync() skips all but the last)",
        f"{_ms(extra * exposed)} per step exposed ({_ms(extra * busy)} of all-reduce busy time; of "
        f"{_ms(p.seconds_per_step.step.mean)})", extra * exposed, "step",
        f"{_at(s.sites, 'backward', 'the backward')}: run the first {max(1, round(micro) - 1)} micro-batches' forward "
        f"and backward inside 'with model.no_sync():' ({_at(s.sites, 'ddp', 'the DDP model built')})")


def _unused(p: ProfileRecord) -> Finding | None:
    s = p.script
    found = [m for m in (s.models if s is not None else []) if m.find_unused_parameters and not m.static_graph
             and m.unused_parameter_bytes == 0]
    if s is None or not found:
        return None
    return Finding(
        "find_unused_parameters", "find_unused_parameters=True, and DDP's reducer found no parameter unused "
                                  "(its last sampled iteration)",
        "not separable from the forward phase (a traversal of the autograd graph after every forward; forward: "
        f"{_ms(p.seconds_per_step.forward.mean)} per step); --verify with the --try below measures it", None, "step",
        f"{_at(s.sites, 'ddp', 'DistributedDataParallel(...)')}: drop find_unused_parameters=True (or pass "
        "static_graph=True where the unused parameters never change)", "ddp.static_graph=true")


def _host_syncs(p: ProfileRecord) -> Finding | None:
    s = p.script
    if s is None or s.host_syncs_per_step is None or s.host_syncs_per_step < 1 or p.device != "cuda":
        return None
    return Finding(
        "host_syncs", f"{s.host_syncs_per_step:g} host synchronization(s) per step (.item(), a copy to the CPU: "
                      "the host waits for the GPU, and the GPU then waits for the host's next launches)",
        "not separable from the phases around it (the wait is inside the phase that synchronizes; 'other': "
        f"{_ms(p.seconds_per_step.other.mean)} per step)", None, "step",
        f"{_at(s.sites, 'backward', 'around the backward')}: keep the loss on the GPU (accumulate it there, read it "
        "every N steps), and print or log from that")


def _restarts(p: ProfileRecord) -> Finding | None:
    s = p.script
    loader = s.loader if s is not None else None
    if s is None or loader is None or loader.iterators < 2 or not loader.num_workers or loader.persistent_workers:
        return None
    # A batch's usual time from the one before (a step draws one per micro-batch).
    usual = (p.seconds_per_step.data.mean + p.seconds_per_step.other.mean) / max(1.0, s.micro_batches_per_step)
    restarts = loader.first_batch_seconds
    cost = max(0.0, sum(restarts) / len(restarts) - usual) if restarts else None
    measured = (f"{_ms(cost)} per epoch: its first batch took {_ms(sum(restarts) / len(restarts))} after the "
                f"step before, against {_ms(usual)} for any other batch ({len(restarts)} epoch(s) after the first)"
                if cost is not None else "the first batch of each epoch was not timed")
    return Finding(
        "loader_restarts", f"{loader.iterators} epochs, each starting the loader's {loader.num_workers} worker "
                           "processes again (persistent_workers=False)",
        measured, cost, "epoch",
        f"{_at(s.sites, 'loader', 'DataLoader(...)')}: pass persistent_workers=True", "loader.persistent_workers=true")


FINDERS = (_no_sync, _unused, _host_syncs, _restarts)


def findings(profile: ProfileRecord) -> list[Finding]:
    """What the script does that only a script run shows, each with its cost and fix (none for a Trial's run)."""
    if profile.script is None:
        return []
    return [f for f in (find(profile) for find in FINDERS) if f is not None]


def render(found: list[Finding]) -> str:
    """The findings as text lines under the doctor's table."""
    out = ""
    for f in found:
        out += (f"script: {f.seen}\n  cost: {f.cost}\n  fix: {f.fix}\n"
                + (f"  measure: dtrain doctor RUN --try {f.verify} --verify\n" if f.verify else ""))
    return out
