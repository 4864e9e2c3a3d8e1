"""What the launcher prints when a run ends: throughput, the time-cost table and the doctor's verdict."""

from __future__ import annotations

import os
from pathlib import Path

from rich.table import Table

from dtrain.explain import sharded
from dtrain.explain.doctor import diagnose
from dtrain.explain.efficiency import efficiency_lines
from dtrain.explain.render import as_text, interval
from dtrain.profiling.record import ProfileRecord, load_profile
from dtrain.profiling.runsummary import load_summary


def time_cost_table(profile: ProfileRecord) -> str:
    """Per-phase ms per step (min / mean / max across ranks) and share of the step, plus communication.
    Phases the run did not observe get no row: their time is in ``other``, marked ``other*``, and a line
    below the table says why."""
    spread = profile.seconds_per_step
    step = spread.step.mean
    profiled, timed = profile.profiled_steps, profile.timed_steps
    sampled = f", {timed} timed" if timed != profiled else ""  # profiling.sample_every
    missing = set(profile.unobserved_phases or [])
    # The counts go below the table: in the title they made it wrap on a narrow table.
    table = Table(title=f"time cost per step ({profile.slots} slot(s))",
                  caption=f"{profiled} steps profiled{sampled}")
    for col in ("phase", "min ms", "mean ms", "max ms", "share"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for phase in (*profile.phases, "step"):
        if phase in missing:
            continue
        s = spread.of(phase)
        share = f"{100 * s.mean / step:.0f}%" if step else "-"
        name = "other*" if phase == "other" and missing else phase
        table.add_row(name, f"{1e3 * s.min:.3f}", f"{1e3 * s.mean:.3f}", f"{1e3 * s.max:.3f}", share)
    comm = profile.comm
    text = as_text(table)
    if missing:  # the doctor's verdict below gives the fix
        text += f"* other includes {', '.join(p for p in profile.phases if p in missing)}: not observed\n"
    if profile.slots > 1 and not profile.comm_measured:  # FSDP: its collectives are inside forward and backward
        probed = sharded.probe_words(profile)
        text += (f"communication: not timed (sync.strategy {profile.strategy} communicates inside forward and "
                 f"backward, counted there){'; ' + probed if probed else ''}; an all-reduce of one float after the "
                 f"run took {1e3 * comm.latency_seconds:.3f} ms\n")
    elif profile.slots > 1:
        exposed = ("not observed" if "comm_exposed" in missing
                   else f"{1e3 * comm.exposed_seconds_per_step:.3f} ms")
        text += (
            f"communication: {comm.bytes_per_step / 1e6:.3f} MB all-reduced per step in "
            f"{comm.buckets_per_step:.0f} all-reduce(s), busy {1e3 * comm.busy_seconds_per_step:.3f} ms "
            f"(exposed {exposed}), "
            f"{comm.algbw_bytes_per_second / 1e9:.3f} GB/s algbw, "
            f"{comm.busbw_bytes_per_second / 1e9:.3f} GB/s busbw, "
            f"latency {1e3 * comm.latency_seconds:.3f} ms\n")
    return text + "".join(f"{line}\n" for line in efficiency_lines(profile))


def short_verdict(profile: ProfileRecord, limit: int = 3) -> str:
    diagnosis = diagnose(profile)
    lines = [f"doctor: {diagnosis.verdict}"]
    for rec in diagnosis.recommendations[:limit]:
        between = f" ({interval(rec.predicted_interval)})" if rec.predicted_interval is not None else ""
        lines.append(f"  try {rec.action:<48} predicted {rec.predicted_speedup:.2f}x samples/s{between} "
                     f"({rec.factor})")
    return "\n".join(lines)


def print_run_summary(run_dir: Path, seconds: float, quiet: bool = False) -> None:
    """The end of a run: throughput, the time-cost table, the doctor's verdict, the report's path; with
    ``quiet`` one line (throughput, validation, report)."""
    path = run_dir / "summary.json"
    if not path.exists():
        return
    s = load_summary(path)
    val = "  ".join(f"{k} {v:.4f}" for k, v in s.validation.items())
    done = f"dtrain: done in {seconds:.1f}s: {s.batches} batches on {s.slots} slot(s), "
    if s.resumed_at_batch and s.membership_changes:  # an elastic job: the figures cover its last world only
        done = (f"dtrain: done in {seconds:.1f}s: {s.batches} batches, {len(s.membership_changes)} membership "
                f"change(s); the last stretch (batches {s.resumed_at_batch}-{s.batches}) on {s.slots} slot(s): ")
    done += f"{s.samples_per_second:,.0f} samples/s" + (f"; validation: {val}" if val else "")
    done += probes_note(run_dir)
    report = _write_report(run_dir)
    if quiet:
        print(done + (f"; report {report}" if report is not None else ""))
        return
    print(done)
    if (run_dir / "profile.json").exists():  # profiling off: nothing to say about it here
        print_profile(run_dir)
    if report is not None:
        print(f"dtrain: report {report}  (details: dtrain doctor {run_dir})")


# From this long the end-of-run probes are worth a word: a user who sees "done in" well past the training time
# learns where it went and how to skip it.
PROBES_WORTH_SAYING_SECONDS = 1.0


def probes_note(run_dir: Path) -> str:
    """'; end-of-run probes N.Ns (...)' where the probes took :data:`PROBES_WORTH_SAYING_SECONDS` or more."""
    path = run_dir / "profile.json"
    if not path.exists():
        return ""
    seconds = load_profile(path).probe_seconds
    if seconds is None or seconds < PROBES_WORTH_SAYING_SECONDS:
        return ""
    return (f"; end-of-run probes {seconds:.1f}s (what the doctor prices changes by; profiling.probes: false "
            "skips them)")


def print_profile(run_dir: Path) -> None:
    """The time-cost table and the doctor's short verdict from ``RUN_DIR/profile.json``, or why not."""
    profile_path = run_dir / "profile.json"
    if not profile_path.exists():
        print(f"dtrain: no profile.json in {run_dir}: no time table (profiling off, or the run did not finish)")
        return
    profile = load_profile(profile_path)
    if profile.profiled_steps > 0:
        print(time_cost_table(profile), end="")
        print(short_verdict(profile))
    else:
        print(f"dtrain: no step profiled ({profile.steps} steps, all within profiling.warmup_steps): "
              "train longer for a time-cost breakdown")


def _write_report(run_dir: Path) -> Path | None:
    # Drawing the page's charts costs about a second of CPU (matplotlib): batch use (CI, a test suite,
    # scripted sweeps) may leave it to a later `dtrain report RUN_DIR`.
    if os.environ.get("DTRAIN_REPORT", "1") == "0":
        return None
    try:
        from dtrain.explain.report import write_report
    except ImportError:  # pragma: no cover - report module is optional at this point
        return None
    return write_report(run_dir)
