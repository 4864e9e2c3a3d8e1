"""Determined's optimizations where communication dominates: 2 test hosts x 1 slot over a link limited to
200 Mbit/s (tc tbf), a ~10M-parameter MLP on digits (hidden 3072). Root (network namespaces).

    .venv/bin/python bench/optimizations.py [--rate 200mbit] [--steps 20] [--repeats 3] [--cases none,powersgd]
                                            [--skip-accuracy] [--json out.json]
                                            [--baseline-src OLD_CHECKOUT]

1. Step time and communication time per step on the link: none, fp16, bf16, powersgd (rank 4, compressing
   from step 2), aggregation_frequency 4. Goals: fp16 comm <= 0.55x none; powersgd step speed-up >= 5x;
   aggregation 4 >= 3x samples/s. The doctor's recommendation for the uncompressed run is printed too.
   Every case runs ``--repeats`` times, the cases alternating (round r runs them all, in an order rotated
   by r), so that a change in the machine's load hits every case alike; each figure is the median with
   its min-max spread, and a speed-up is the median of the per-round ratios (both runs in one round).
2. Accuracy: the same model trained to the end on this host (accuracy does not depend on the link),
   uncompressed vs powersgd. Goal: within 1 point.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dtrain.profiling.record import ProfileRecord, load_profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
CONFIG = ROOT / "examples" / "digits" / "experiment.yaml"
WIDE = ["hyperparameters.hidden=3072", "hyperparameters.lr=0.02", "min_validation_period=null",
        "min_checkpoint_period=null"]
# Profile whole aggregation groups of 4: steps 5..20 hold exactly 4 exchanges in 16 steps.
LINK = ["profiling.warmup_steps=4"]
CASES = {
    "none": [],
    "fp16": ["optimizations.gradient_compression=fp16"],
    "bf16": ["optimizations.gradient_compression=bf16"],
    "powersgd": ["optimizations.gradient_compression=powersgd", "optimizations.powersgd.rank=4",
                 "optimizations.powersgd.start_iteration=2"],
    "aggregation 4": ["optimizations.aggregation_frequency=4"],
}


def two_hosts(rate: str, tmp: Path, tag: str, steps: int, overrides: list[str], src: Path | None = None) -> Path:
    """Run the wide digits model on 2 hosts x 1 slot; return the run directory. ``src``: run another
    checkout's dtrain package (its ``src`` folder) instead of this one."""
    from link import PORT, _run_pair
    from testhosts import TestHosts

    run_dir = tmp / tag.replace(" ", "-")
    sets = [*WIDE, *LINK, f"max_length={{batches: {steps}}}", *overrides]
    with TestHosts(2, rate=rate, pin_cpus=True) as hosts:
        def argv(i: int) -> list[str]:
            cmd = [sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--slots", "2", "--nnodes", "2",
                   "--node-rank", str(i), "--master", f"{hosts.hostname(0)}:{PORT}", "--run-dir", str(run_dir),
                   "--quiet"]
            for item in sets:
                cmd += ["--set", item]
            return cmd
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"PYTHONPATH": str(src)} if src else {})}
        _run_pair(hosts, argv, env, timeout=900)
    return run_dir


def one_host_accuracy(tmp: Path, tag: str, overrides: list[str]) -> float:
    run_dir = tmp / f"acc-{tag}"
    cmd = [sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--quiet", "--run-dir", str(run_dir)]
    for item in [*WIDE, *overrides]:
        cmd += ["--set", item]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=1800)
    return json.loads((run_dir / "summary.json").read_text())["validation"]["accuracy"]


def _spread(values: list[float], fmt: str) -> str:
    """``median (min-max)`` of repeated measurements."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def _row(profile: ProfileRecord) -> dict[str, float]:
    comm = profile.comm
    return {"mb": comm.bytes_per_step / 1e6, "collectives": comm.buckets_per_step,
            "busy": comm.busy_seconds_per_step, "step": profile.seconds_per_step.step.mean,
            "samples": profile.samples_per_second}


def link_table(rate: str, steps: int, rounds: list[dict[str, dict[str, float]]], parameters: float) -> list[str]:
    """Markdown table: median (min-max) over the rounds; ratios to none are taken within each round."""
    from link import _rate_bytes_per_second

    bandwidth = _rate_bytes_per_second(rate)
    names = list(rounds[0])
    lines = [f"## 2 hosts x 1 slot, link {rate}, {parameters / 1e6:.1f}M parameters, {steps} steps per case, "
             f"{len(rounds)} rounds (median, min-max)",
             "| case | MB sent/step | all-reduces/step | link bound s/step | comm busy s/step | comm vs none | "
             "step s | samples/s | speed-up vs none |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        runs = [r[name] for r in rounds]
        mb = statistics.median(x["mb"] for x in runs)
        # Ring all-reduce on 2 hosts: each sends 2(N-1)/N = 1x the bytes over its own link.
        bound = mb * 1e6 / bandwidth
        ratios = {key: [r[name][key] / r["none"][key] for r in rounds] for key in ("busy", "samples")} \
            if "none" in names else None
        lines.append(
            f"| {name} | {mb:.2f} | {statistics.median(x['collectives'] for x in runs):.3g} | {bound:.3f} | "
            f"{_spread([x['busy'] for x in runs], '.3f')} | "
            f"{_spread(ratios['busy'], '.2f') + 'x' if ratios else '-'} | "
            f"{_spread([x['step'] for x in runs], '.3f')} | {_spread([x['samples'] for x in runs], ',.0f')} | "
            f"{_spread(ratios['samples'], '.2f') + 'x' if ratios else '-'} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--steps", type=int, default=20, help="steps per case on the link (4 are warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all cases (default 3)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--json", type=Path, help="also write every run's figures here (after every round)")
    parser.add_argument("--resume", action="store_true", help="keep the finished rounds of --json's file (same "
                        "rate, steps and cases) and run only the missing ones: for a run that was killed")
    parser.add_argument("--baseline-src", type=Path, help="also run powersgd with the dtrain of this checkout's "
                        "src/ (e.g. a worktree of an older commit), in the same rounds: before/after side by side")
    args = parser.parse_args()
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names or args.repeats < 1:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}" if unknown else "nothing to run")
    cases: dict[str, tuple[list[str], Path | None]] = {name: (CASES[name], None) for name in names}
    if args.baseline_src:
        src = args.baseline_src.resolve() / "src"
        if not (src / "dtrain").is_dir():
            parser.error(f"--baseline-src: no dtrain package under {src}")
        cases[f"powersgd, {args.baseline_src.name}"] = (CASES["powersgd"], src)
    names = list(cases)
    from testhosts import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"bench/optimizations.py: {reason}", file=sys.stderr)
        return 2
    # SIGTERM as an exception: the test hosts' namespaces are torn down on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    verdict: list[str] = []
    rounds: list[dict[str, dict[str, float]]] = []
    load = [os.getloadavg()[0]]
    parameters = 0.0
    if args.resume and args.json and args.json.exists():
        saved = json.loads(args.json.read_text())
        if (saved["rate"], saved["steps"], list(saved["rounds"][0]) if saved["rounds"] else names) != \
                (args.rate, args.steps, names):
            parser.error(f"--resume: {args.json} holds another benchmark (rate, steps or cases differ)")
        rounds, load, parameters = saved["rounds"], saved["load"], saved.get("parameters", 0.0)
        verdict = saved.get("verdict", [])

    def save(**extra: object) -> None:
        if args.json:
            args.json.write_text(json.dumps({"rate": args.rate, "steps": args.steps, "rounds": rounds, "load": load,
                                             "parameters": parameters, "verdict": verdict, **extra}, indent=2))

    with tempfile.TemporaryDirectory(prefix="dtrain-opt-") as tmp:
        for r in range(len(rounds), args.repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            results: dict[str, dict[str, float]] = {}
            for name in order:
                print(f"round {r + 1}/{args.repeats}: {name} ...", file=sys.stderr, flush=True)
                overrides, src = cases[name]
                run_dir = two_hosts(args.rate, Path(tmp), f"{name.replace(',', '')}-{r}", args.steps, overrides, src)
                profile = load_profile(run_dir / "profile.json")
                results[name] = _row(profile)
                parameters = profile.parameters
                if name == "none" and not verdict:
                    doctor = subprocess.run([sys.executable, "-m", "dtrain.cli", "doctor", str(run_dir)],
                                            capture_output=True, text=True, cwd=ROOT)
                    if "verdict" in doctor.stdout:
                        verdict.append(doctor.stdout[doctor.stdout.index("verdict"):].replace("\n", " "))
            rounds.append({name: results[name] for name in names})
            load.append(os.getloadavg()[0])
            save()  # after every round: a run cut short still leaves its finished rounds
        print("\n".join(link_table(args.rate, args.steps, rounds, parameters)))
        print(f"\nload average (1 min) at the start and after each round: {', '.join(f'{x:.1f}' for x in load)} "
              f"on {os.cpu_count()} CPUs")
        if verdict:
            print(f"\ndoctor on the uncompressed run: {verdict[0]}")
        accuracy = {}
        if not args.skip_accuracy:
            print("running accuracy runs on one host ...", file=sys.stderr, flush=True)
            accuracy = {"none": one_host_accuracy(Path(tmp), "none", []),
                        "powersgd": one_host_accuracy(Path(tmp), "powersgd", CASES["powersgd"])}
            print(f"\ndigits accuracy after 30 epochs, 2 slots on one host: none {accuracy['none']:.4f}, "
                  f"powersgd {accuracy['powersgd']:.4f} "
                  f"(difference {100 * (accuracy['powersgd'] - accuracy['none']):+.2f} points)")
    save(accuracy=accuracy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
