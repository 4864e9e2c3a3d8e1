"""A sharded (FSDP) run's collectives, out of its compute, and what a replica per slot (DDP) would give.

The run timed FSDP's all-gathers and reduce-scatters inside forward and backward. Its end-of-run probe
(``profile.sharded_exchange``, :mod:`dtrain.profiling.shardprobe`) ran the same forward and backward with the
parameters held gathered: that is the step's compute, and the rest of the run's forward and backward is the
collectives and the waiting for them. Where that probe ran, DDP's footprint (parameters, gradients, buckets, the
optimizer's whole state) fit on every slot, so DDP is a change the user can make: priced by the cost model as a
DDP run of the same slots, with the compute just measured, the gradients all-reduced over the link the run's
ranks measured at its end, and the data and optimizer as they were (the optimizer stepped its shard; DDP's steps
every parameter on every slot, which on a memory-bound device costs up to ``slots`` times as much: said, not
priced).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dtrain.explain.costmodel import CostModel, Source
from dtrain.explain.facts import Facts, Work, sharded_split
from dtrain.profiling.record import ALL_REDUCE, ProfileRecord

# Beyond the link, DDP's exchange in training waits and wakes up: not measured on a sharded run. Its share of
# a step's uncertainty is held at this (the doctor's "DDP instead" is a measured-compute estimate).
NOT_MEASURED = "exchange in training beyond the link (DDP's own hooks and waiting): not measured, 0 assumed"


@dataclass(frozen=True, slots=True)
class Split:
    """A sharded run's forward and backward per step, split: ``compute`` (the probe's, parameters held
    gathered) and ``collectives`` (the rest of the run's: FSDP's all-gathers, reduce-scatters and waiting)."""

    compute: float
    collectives: float


def split(profile: ProfileRecord, run_compute: float) -> Split | None:
    """``run_compute`` (a rank's forward + backward per step) split by the probe; None where not probed. The
    probe's least local step is the compute; all the rest of the run's mean counts as collectives. Splitting the
    mean in the probe's proportion instead put far more compute in DDP than DDP's own run measured
    (docs/benchmarks.md)."""
    found = sharded_split(profile, run_compute)
    return Split(*found) if found is not None else None


def probe_words(profile: ProfileRecord) -> str:
    """The probe's figures in words ('' where not probed), for the summary and the report."""
    probe = profile.sharded_exchange
    if probe is None:
        return ""
    return (f"at the end of the run, forward and backward took {1e3 * probe.step_seconds:.3f} ms with its "
            f"collectives and {1e3 * probe.local_seconds:.3f} ms with the parameters held gathered (dtrain doctor "
            "splits the step by it)")


@dataclass(frozen=True, slots=True)
class Instead:
    """DDP on the same slots, by the cost model: gain over the run's samples/s and its 80% interval."""

    gain: float
    low: float
    high: float


def ddp_instead(profile: ProfileRecord) -> Instead | None:
    """The run as DDP would run it on the same slots (None where the probe did not run, or no link was
    measured among the ranks to price the all-reduce on)."""
    f = Facts.from_profile(profile)  # the run's own compute, collectives inside (the model's has them apart)
    found = split(profile, f.compute)
    if found is None or f.slots < 2 or not f.link_points:
        return None
    batch = f.per_slot_batch
    # The measured compute at the run's batch (a change of batch is the FSDP model's, not this one's).
    work = Work({f.threads: (0.0, found.compute / batch)}) if batch else f.work
    # The run's step jitter is mostly its collectives' waiting (each all-gather waits for the slowest rank),
    # which DDP's one exchange does not repeat: not carried over.
    facts = replace(f, exchange=ALL_REDUCE, compute=found.compute, work=work, step=f.step - found.collectives,
                    jitter=0.0, replica_of_sharded=True)
    ddp = CostModel.from_facts(facts)
    ddp = replace(ddp, overhead=0.0, overhead_source="none", exchange_scale=1.0, factor=1.0,
                  sources=[*ddp.sources, Source("exchange in training beyond the link", NOT_MEASURED, "assumed")])
    # Over the run as measured: two models (FSDP's and this one) share no bias that a ratio would cancel.
    found_ddp = ddp.predict(ddp.measured_target())
    measured = f.global_batch / f.step
    return Instead(found_ddp.samples_per_second / measured, found_ddp.samples_per_second_low / measured,
                   found_ddp.samples_per_second_high / measured)
