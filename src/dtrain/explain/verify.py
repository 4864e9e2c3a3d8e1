"""``dtrain doctor RUN_DIR --verify``: measure the doctor's advice instead of trusting it.

The doctor predicts each recommendation's speed-up from one profile. Here each of its top
recommendations, and two bisection experiments, runs as a short training of the same trial on the same
slots with the run's resolved config patched (``--set``-style overrides, in-process as ``dtrain bench``
does), beside a baseline of the unpatched config measured in the same session:

* bisection, communication off: ``optimizations.aggregation_frequency`` = the step count (one exchange
  in the whole short run), the ceiling of any communication fix (Determined's advice, automated);
* bisection, data loading off: ``data_loader.synthetic: true`` (one batch reused), the ceiling of any
  loader fix.

Each experiment's measured speed-up is its samples/s over the baseline's (steady state, from each short
run's ``profile.json``). With ``repeats`` > 1 the experiments run in rounds (baseline first in every
round, so drift on a shared machine hits all alike) and the median counts. The best recommendation
that beats the baseline is written as ``RUN_DIR/tuned.yaml``: the run's full config with that one change
(for a bigger batch, with the learning rate rescaled when the config names it, as the doctor says).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.errors import UserError
from dtrain.profiling.record import ProfileRecord, load_profile, load_run_profile

MIN_STEPS = 10


@dataclass
class Experiment:
    """One short run: ``sets`` on top of the run's config."""

    action: str
    kind: str  # "baseline" | "recommendation" | "bisection"
    sets: list[str]
    predicted_speedup: float | None = None
    factor: str | None = None
    samples_per_second: list[float] = field(default_factory=list)

    @property
    def measured(self) -> float | None:
        return statistics.median(self.samples_per_second) if self.samples_per_second else None


def plan_experiments(diagnosis: dict[str, Any], profile: ProfileRecord, steps: int, top: int) -> list[Experiment]:
    """Baseline, the doctor's first ``top`` recommendations, and the two bisection experiments."""
    from dtrain.explain.advice import batch_change

    out = [Experiment("baseline", "baseline", [])]
    for rec in diagnosis["recommendations"][:top]:
        sets = [f"{rec['key']}={_yaml(rec['value'])}"]
        if rec["key"] == "hyperparameters.global_batch_size":
            sets += batch_change(profile, int(rec["value"]))["sets"]
        out.append(Experiment(rec["action"], "recommendation", sets, rec["predicted_speedup"], rec["factor"]))
    by_factor = {f["factor"]: f for f in diagnosis["factors"]}
    step = float(diagnosis["step_seconds"])

    def ceiling(*factors: str) -> float:
        saved = sum(float(by_factor[f]["seconds_per_step"]) for f in factors if f in by_factor)
        return step / (step - saved) if step > saved else float("inf")

    if profile.slots > 1 and profile.aggregation_frequency < steps:
        out.append(Experiment("bisection: communication off (aggregation_frequency = steps)", "bisection",
                              [f"optimizations.aggregation_frequency={steps}"],
                              ceiling("communication", "sync_frequency", "straggler"), "communication"))
    if not profile.synthetic_data:
        out.append(Experiment("bisection: data loading off (synthetic data)", "bisection",
                              ["data_loader.synthetic=true"], ceiling("data_loading"), "data_loading"))
    return out


def _yaml(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _short_run(config: Path, exp: Experiment, steps: int, out: Path, debug: bool) -> float:
    from dtrain.launcher import runs

    sets = [*exp.sets, f"max_length={{batches: {steps}}}", "min_validation_period=null",
            "min_checkpoint_period=null", f"scheduling_unit={steps}", "profiling.enabled=true"]
    plan = runs.prepare(config, sets, run_dir=out, resume=None)
    failure = runs.execute(plan, quiet=True, debug=debug)
    if failure is not None:
        raise UserError(f"--verify: {exp.action} failed on rank {failure.rank}: {failure.message} "
                        f"(logs in {out / 'logs'})")
    return load_profile(out / "profile.json").samples_per_second


def verify(run_dir: Path, steps: int, repeats: int = 1, top: int = 3, debug: bool = False,
           log: Any = print) -> dict[str, Any]:
    """Run every experiment (``repeats`` rounds), write ``tuned.yaml`` when a change beats the baseline;
    returns the ``--json`` document."""
    from dtrain.explain.doctor import diagnose

    if steps < MIN_STEPS:
        raise UserError(f"--steps {steps}: a verification run needs at least {MIN_STEPS} steps (the first few are "
                        "warm-up, left out of samples/s)")
    profile = load_run_profile(run_dir)
    diagnosis = diagnose(profile)
    config = run_dir / "config.yaml"
    experiments = plan_experiments(diagnosis, profile, steps, top)
    session = run_dir / f"verify-{time.strftime('%Y%m%d-%H%M%S')}"
    for round_ in range(repeats):
        for i, exp in enumerate(experiments):
            log(f"dtrain doctor --verify: [{round_ + 1}/{repeats}] {exp.action} ...")
            exp.samples_per_second.append(_short_run(config, exp, steps, session / f"r{round_}-{i:02d}", debug))
    base = experiments[0].measured or 0.0
    rows = [{"action": e.action, "kind": e.kind, "factor": e.factor, "sets": e.sets,
             "predicted_speedup": e.predicted_speedup,
             "measured_speedup": e.measured / base if base and e.measured else None,
             "samples_per_second": e.measured, "samples_per_second_runs": e.samples_per_second}
            for e in experiments[1:]]
    rows.sort(key=lambda r: r["measured_speedup"] or 0.0, reverse=True)
    tuned = _write_tuned(run_dir, config, rows)
    return {"run_dir": str(run_dir), "steps": steps, "repeats": repeats, "slots": profile.slots,
            "baseline_samples_per_second": base, "baseline_runs": experiments[0].samples_per_second,
            "verified": rows, "tuned_config": str(tuned) if tuned else None, "session_dir": str(session)}


def _write_tuned(run_dir: Path, config: Path, rows: list[dict[str, Any]]) -> Path | None:
    """The run's config with the best measured recommendation, if it beat the baseline."""
    from dtrain.config.schema import dump_config, load_config

    best = next((r for r in rows if r["kind"] == "recommendation" and (r["measured_speedup"] or 0) > 1.0), None)
    if best is None:
        return None
    path = run_dir / "tuned.yaml"
    dump_config(load_config(config, best["sets"]), path)
    note = (f"# dtrain doctor --verify: {best['action']} measured {best['measured_speedup']:.2f}x samples/s "
            f"(predicted {best['predicted_speedup']:.2f}x) over this run's config;\n"
            f"# changes: {', '.join(best['sets'])}\n")
    path.write_text(note + path.read_text())
    return path


def render(result: dict[str, Any]) -> str:
    """Predicted vs measured, best measured first."""
    from rich.table import Table

    from dtrain.explain.render import as_text

    base = result["baseline_samples_per_second"]
    table = Table(title=f"dtrain doctor --verify: {result['slots']} slot(s), {result['steps']} steps x "
                        f"{result['repeats']} round(s); baseline {base:,.0f} samples/s")
    for col in ("action", "kind", "samples/s", "predicted", "measured"):
        table.add_column(col, justify="left" if col in ("action", "kind") else "right")
    for r in result["verified"]:
        table.add_row(r["action"], r["kind"], f"{r['samples_per_second']:,.0f}",
                      f"{r['predicted_speedup']:.2f}x" if r["predicted_speedup"] else "-",
                      f"{r['measured_speedup']:.2f}x" if r["measured_speedup"] else "-")
    text = as_text(table, width=140)
    text += (f"tuned config: {result['tuned_config']}\n" if result["tuned_config"]
             else "no recommendation beat the baseline: no tuned.yaml written\n")
    return text
