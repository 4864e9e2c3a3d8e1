"""Two figures beside the time table, in words: the first steps apart from the steady state, and MFU.

Read from ``profile.json`` (``first_steps``: dtrain.profiling.warmup; ``flops``: dtrain.profiling.flops);
the end-of-run summary, the report and the doctor show the same lines. A profile written before these
sections existed has neither: then there is nothing to say.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.profiling.record import ProfileRecord


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _flop(count: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.0f} FLOP"


def first_steps_line(profile: ProfileRecord) -> str | None:
    """Time to the first step, steady against all-steps throughput, and what the first steps cost."""
    first = profile.first_steps
    if first is None:
        return None
    to_first = f"first step {_ms(first.first_step_seconds)}"
    if first.time_to_first_step_seconds is not None:
        to_first = (f"{_ms(first.time_to_first_step_seconds)} to the first step (start-up "
                    f"{_ms(first.startup_seconds or 0.0)}, {to_first})")
    spent = [f"{first.allocator_segments} new allocator segment(s) in them, {first.allocator_segments_later} later"
             if first.allocator_segments is not None else "",
             "autotuning: " + "; ".join(first.autotuning) if first.autotuning else ""]
    detail = "; ".join(s for s in spent if s)
    return (f"first steps: {to_first}; the first {first.steps} step(s) took {_ms(first.seconds)}, "
            f"{_ms(first.excess_seconds)} more than as many steady steps ({_ms(first.steady_step_seconds)} each)"
            + (f" ({detail})" if detail else "")
            + f"; steady state {profile.samples_per_second:,.0f} samples/s, all steps "
              f"{profile.samples_per_second_all_steps:,.0f}")


def mfu_line(profile: ProfileRecord) -> str | None:
    """Model FLOPs utilization, in total and per slot, against the measured peak it is relative to."""
    flops = profile.flops
    if flops is None:
        return None
    slots = (" (per slot: " + ", ".join(f"{100 * m:.3g}%" for m in flops.mfu_per_slot) + ")"
             if len(flops.mfu_per_slot) > 1 else "")
    return (f"MFU: {100 * flops.mfu:.3g}%{slots} of the {flops.peak} ({_flop(flops.peak_flops_per_second)}/s); "
            f"{_flop(flops.flops_per_step)} per step per slot (forward and backward)")


def efficiency_lines(profile: ProfileRecord) -> list[str]:
    """The lines the summary, the report and the doctor show (none for an older profile)."""
    return [line for line in (first_steps_line(profile), mfu_line(profile)) if line is not None]


@dataclass(frozen=True, slots=True)
class Efficiency:
    """What the doctor adds to its diagnosis: MFU in total and per slot, the first steps' excess over steady
    ones, and the lines the summary, the report and the doctor show (None and none for an older profile)."""

    mfu: float | None
    mfu_per_slot: list[float] | None
    first_steps_excess_seconds: float | None
    lines: list[str]

    @classmethod
    def of(cls, profile: ProfileRecord) -> Efficiency:
        flops, first = profile.flops, profile.first_steps
        return cls(flops.mfu if flops is not None else None, flops.mfu_per_slot if flops is not None else None,
                   first.excess_seconds if first is not None else None, efficiency_lines(profile))

    def to_json(self) -> dict[str, object]:
        return {"mfu": self.mfu, "mfu_per_slot": self.mfu_per_slot,
                "first_steps_excess_seconds": self.first_steps_excess_seconds, "efficiency": self.lines}
