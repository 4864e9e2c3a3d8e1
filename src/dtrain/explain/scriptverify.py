"""``dtrain doctor RUN --verify`` on a script's run: the script run again with each change made from outside,
paired against a baseline in alternating rounds (:func:`dtrain.explain.verify.measure`, as for a Trial).

Each short run is the recorded command in the recorded working directory on the recorded slots (a ``slots=N``
change: N), profiled into the session's scratch folder under the run directory; every rank stops together after
``--steps`` optimizer steps (``DTRAIN_PROFILE_STEPS``), and the change travels in ``DTRAIN_SCRIPT_OVERRIDES``
(:mod:`dtrain.profiling.script.overrides`). The script's own writes (checkpoints, loggers) go where it puts them:
that is said once. A script changed since the run is refused: its figures would not be the run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dtrain.errors import UserError
from dtrain.explain import paired, verify
from dtrain.explain.scriptadvice import refusal, suggestions, try_one
from dtrain.profiling.record import ProfileRecord, load_profile
from dtrain.profiling.script import overrides

PROFILE_ENV, STEPS_ENV = "DTRAIN_PROFILE", "DTRAIN_PROFILE_STEPS"  # dtrain.engine.scriptprof's (tests hold them)
NOT_SANDBOXED = ("dtrain doctor --verify: the script runs again for every change and round; its own writes "
                 "(checkpoints, loggers, outputs) are not sandboxed: they go where the script puts them")


def is_script_run(run_dir: Path) -> bool:
    """A run directory a script's profile made (no experiment config beside it)."""
    return (run_dir / "script.json").is_file() and not (run_dir / "config.yaml").is_file()


@contextlib.contextmanager
def _environment(values: dict[str, str], cwd: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    here = os.getcwd()
    os.environ.update(values)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(here)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _runner(profile: ProfileRecord, steps: int, threads: int | None, debug: bool) -> Any:
    """One short run of the script with an experiment's changes; its steady samples/s."""
    from dtrain.launcher import cpu, forkstart
    from dtrain.launcher.agent import LaunchOptions, launch

    script = profile.script
    if script is None:
        raise UserError("--verify: not a script's run")

    def run(exp: verify.Experiment, out: Path) -> float:
        over = overrides.parse(exp.sets)
        slots = over.slots or profile.slots
        env = {PROFILE_ENV: str(out.resolve()), STEPS_ENV: str(steps), overrides.ENV: over.to_env()}
        failed = None
        with _environment(env, script.cwd):
            if script.launcher == "DTRAIN_PROFILE":  # the script starts its own processes
                done = subprocess.run([sys.executable, *script.command], check=False)
                failed = f"exit code {done.returncode}" if done.returncode else None
            else:
                failure = launch(forkstart.script_worker(script.command),
                                 LaunchOptions(slots=slots, debug=debug,
                                               threads=cpu.for_bench(slots)[0] if over.slots else threads))
                failed = failure.headline() if failure is not None else None
        if failed is not None or not (out / "profile.json").is_file():
            raise UserError(f"--verify: {exp.action}: the script's run failed ({failed or 'no profile written'}); "
                            f"its profile folder: {out}")
        return load_profile(out / "profile.json").samples_per_second

    return run


def open_script(run_dir: Path, items: list[str] | None, steps: int, repeats: int, max_repeats: int | None,
                target_spread: float, log: Any) -> tuple[verify.Session, list[verify.Experiment]]:
    """Check the run and the changes (one line each where they cannot run), and plan the experiments:
    ``items`` as given, or the doctor's changes from outside."""
    from dtrain.profiling.script.merge import script_sha256

    held: list[str] = []  # the session's own lines wait until every change is accepted: a refusal is one line
    session = verify.open_session(run_dir, steps, repeats, max_repeats, target_spread, held.append)
    p, script = session.profile, session.profile.script
    if script is None:
        raise UserError(f"{run_dir} is not a script's run; dtrain doctor --verify measures a Trial's from config.yaml")
    if script_sha256(Path(script.script)) != script.script_sha256:
        raise UserError(f"--verify: {script.script} changed since the run (its sha256 differs); profile it again "
                        "with dtrain launch, then verify that run")
    if p.hosts > 1:
        raise UserError(f"--verify: the run spanned {p.hosts} hosts and a short run here cannot; run the changed "
                        "script with dtrain launch --nnodes on the hosts")
    if items is None:
        items = [item for item, _ in suggestions(p, session.diagnosis)]
        if not items:
            raise UserError(f"dtrain doctor --verify: the doctor names no change from outside for {run_dir}; name "
                            "one with --try KEY=VALUE (dtrain doctor --help lists the keys)")
    for item in items:
        why = refusal(try_one(p, item))
        if why is not None:
            raise UserError(f"--try {item} --verify: {why}")
    for line in held:
        log(line)
    log(NOT_SANDBOXED)
    return session, [verify.Experiment("baseline", "baseline", []),
                     *(verify.Experiment(item, "try", [item]) for item in items)]


def verify_script(run_dir: Path, items: list[str] | None, steps: int, repeats: int = 1, debug: bool = False,
                  log: Any = print, max_repeats: int | None = None,
                  target_spread: float = paired.DEFAULT_TARGET_SPREAD) -> dict[str, Any]:
    """Each change (``items``, or the doctor's) measured against the same round's baseline; the ``--json``
    document."""
    session, experiments = open_script(run_dir, items, steps, repeats, max_repeats, target_spread, log)
    base = experiments[0]
    run = _runner(session.profile, session.steps, session.threads, debug)
    rounds, folder = verify.measure(session, experiments, repeats, target_spread, debug, log, run=run)
    rows = [{"try": e.action, "sets": e.sets, **verify.measured_figures(e, base, target_spread)}
            for e in experiments[1:]]
    rows.sort(key=lambda r: r["measured_speedup"] or 0.0, reverse=True)
    return {**verify.session_json(session, repeats, rounds, target_spread, base, folder), "tried": rows,
            "script": session.profile.script.script if session.profile.script else None}


def render(result: dict[str, Any]) -> str:
    """Each change's measured gain (median of per-round ratios over the baseline), best first."""
    from rich.table import Table

    from dtrain.explain.render import as_text, ratio

    rounds = result["rounds"]
    table = Table(title=f"dtrain doctor --verify (script): {result['slots']} slot(s), {result['steps']} steps x "
                        f"{rounds} round(s); baseline {result['baseline_samples_per_second']:,.0f} samples/s")
    for col in ("change", "samples/s", "measured", "range of per-round ratios"):
        table.add_column(col, justify="left" if col in ("change", "range of per-round ratios") else "right")
    for r in result["tried"]:
        sps = r["samples_per_second"]
        table.add_row(r["try"], f"{sps:,.0f}" if sps else "-",
                      f"{ratio(r['measured_speedup'])}x" if r["measured_speedup"] else "-",
                      r["spread_verdict"] if rounds > 1 else "-")
    return as_text(table, width=160) + paired.footer(rounds, "baseline")


def cmd(args: Any, log: Any) -> int:
    """``dtrain doctor RUN --verify [--try KEY=VALUE ...]`` on a script's run: the table (or ``--json``)."""
    result = verify_script(args.run_dir, args.tries or None, args.steps, args.repeats, args.debug, log=log,
                           max_repeats=args.max_repeats, target_spread=args.target_spread)
    print(json.dumps(result, indent=2) if args.json else render(result), end="\n" if args.json else "")
    return 0
