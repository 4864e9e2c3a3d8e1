"""How far a host-bound GPU step moves from one process to the next, and whether the doctor's precision
predictions miss by more than that (issue 45).

    python bench/gpu_spread.py [--seconds 330] [--max-rounds 6] [--precisions bf16-mixed,16-mixed,tf32]
                               [--steps 200] [--warmup 30] [--batch 32] [--json FILE]
    python bench/gpu_spread.py --table bench/data/gpu-spread-h200-2026-11-27-a.json ...-b.json

The doctor predicts another precision from the model's steps timed in the fp32 run's own process; the check
runs that precision in another process. On one H200 a bf16 step of bench/gpu.py's model took 15-22 ms of
host time depending on the process, so one pair of processes cannot tell a biased model from a noisy host.
This runs rounds, each of fresh processes in turn (drift over the minutes hits all alike), until
``--seconds`` would be passed:

* a host-speed probe in this process (a pure-Python loop, and tiny CPU tensor operations: the dispatch a
  host-bound step is made of), so that a slow minute of the machine shows as such;
* the plain bf16 loop of bench/gpu.py, once free to run on any core and once pinned to one core (placement:
  is the spread the scheduler's?), each with its involuntary context switches;
* ``dtrain run`` in fp32, profiled, and ``dtrain doctor --try precision=P`` on it;
* ``dtrain run`` in each precision P, profiled.

Printed: each kind's spread across processes, the doctor's predictions (median of the rounds) against the
median measured gain, and every prediction against every other round's measurement (how often one pair of
processes lands within +/-20%, whatever the model).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu import BASELINE, dtrain_run  # noqa: E402  (bench/ is not a package)

PLAIN = '''
import json, os, sys, torch
sys.path.insert(0, {here!r})
if {core} >= 0:
    os.sched_setaffinity(0, {{{core}}})
from gpu import plain_loop
device = torch.device({device!r})
out = plain_loop({variant!r}, {steps}, {warmup}, {batch}, device=device)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if "ctxt_switches" in line)
out["involuntary_switches"] = int(status["nonvoluntary_ctxt_switches"])
out["cpus"] = len(os.sched_getaffinity(0))
out["threads"] = torch.get_num_threads()
print(json.dumps(out))
'''


def host_speed() -> dict[str, float]:
    """Microseconds per pure-Python loop iteration and per tiny CPU tensor operation, best of 3: the host's
    speed this minute, outside any process under test."""
    import torch

    def python_loop() -> float:
        start = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i & 7
        return 1e6 * (time.perf_counter() - start) / 200_000

    def tensor_ops() -> float:
        a = torch.ones(8)
        start = time.perf_counter()
        for _ in range(5_000):
            a = a.add(1.0).mul(0.5)
        return 1e6 * (time.perf_counter() - start) / 10_000

    return {"python_us": min(python_loop() for _ in range(3)), "tensor_op_us": min(tensor_ops() for _ in range(3))}


def plain_process(args: argparse.Namespace, device: str, core: int) -> dict[str, Any]:
    """The plain bf16 loop in a process of its own (pinned to ``core`` unless it is -1)."""
    code = PLAIN.format(here=str(HERE), device=device, variant=args.plain, steps=args.steps, warmup=args.warmup,
                        batch=args.batch, core=core)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=1200)
    return json.loads(done.stdout.strip().splitlines()[-1])


def children_switches() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_nivcsw


def measured_run(precision: str, args: argparse.Namespace, tmp: Path, tries: tuple[str, ...] = ()) -> dict[str, Any]:
    """One profiled ``dtrain run`` of the GPT trial: steady samples/s, its step and its own probe of its
    precision, the involuntary context switches of its processes; the doctor's answers to ``tries``."""
    before = children_switches()
    run = dtrain_run(precision, True, False, args.steps, args.warmup, args.batch, tmp, tries=tries)
    steps = run.get("model_steps") or {}
    row = {"steady": run["steady"], "step_ms": 1e3 * run["breakdown"].get("step", 0.0),
           "data_ms": 1e3 * run["breakdown"].get("data", 0.0),
           "probe_ms": 1e3 * (steps.get("seconds_per_step") or {}).get(precision, 0.0),
           "probe_host_ms": 1e3 * (steps.get("host_seconds_per_step") or {}).get(precision, 0.0),
           "involuntary_switches": children_switches() - before}
    if tries:
        row["doctor"] = {k: v for k, v in (run.get("doctor") or {}).items() if not k.startswith("_")}
        row["probe_all_ms"] = {k: 1e3 * v for k, v in (steps.get("seconds_per_step") or {}).items()}
        row["probe_host_all_ms"] = {k: 1e3 * v for k, v in (steps.get("host_seconds_per_step") or {}).items()}
    return row


def spread(values: list[float], spec: str = ",.1f") -> str:
    """min / median / max and one relative standard deviation (of the logs) of a list of figures."""
    if not values:
        return "-"
    logs = [math.log(v) for v in values]
    sd = statistics.stdev(logs) if len(logs) > 1 else 0.0
    low, mid, high = (format(v, spec) for v in (min(values), statistics.median(values), max(values)))
    return f"{low} / {mid} / {high}, sd {100 * sd:.1f}%"


def one_round(args: argparse.Namespace, device: str, core: int, tmp: Path) -> dict[str, Any]:
    """Every kind of process once, in turn."""
    row: dict[str, Any] = {"host_before": host_speed()}
    row["plain"] = plain_process(args, device, -1)
    row["plain_pinned"] = plain_process(args, device, core)
    tries = tuple(f"precision={p}" for p in args.precisions)
    row["fp32"] = measured_run("32-true", args, tmp, tries)
    row["runs"] = {p: measured_run(p, args, tmp) for p in args.precisions}
    row["host_after"] = host_speed()
    return row


def print_round(i: int, row: dict[str, Any], precisions: list[str]) -> None:
    said = row["fp32"].get("doctor", {})
    parts = [f"plain {row['plain']['steady']:,.0f} (pinned {row['plain_pinned']['steady']:,.0f})",
             f"fp32 {row['fp32']['steady']:,.0f}"]
    for p in precisions:
        gain = row["runs"][p]["steady"] / row["fp32"]["steady"]
        predicted = (said.get(p) or {}).get("gain")
        parts.append(f"{p} {row['runs'][p]['steady']:,.0f} ({gain:.2f}x; predicted "
                     f"{'-' if predicted is None else f'{predicted:.2f}x'})")
    host = row["host_before"]
    print(f"  round {i}: " + ", ".join(parts) + f"; host {host['python_us']:.3f} us/iter, "
          f"{host['tensor_op_us']:.2f} us/op", flush=True)


def summarize(rows: list[dict[str, Any]], precisions: list[str]) -> None:
    print(f"\n{len(rows)} rounds (min / median / max, sd of the logs):")
    print("| process | samples/s | involuntary switches |\n|---|---|---|")
    for name, pick in (("plain bf16 loop, any core", lambda r: r["plain"]),
                       ("plain bf16 loop, one core", lambda r: r["plain_pinned"]),
                       ("dtrain fp32", lambda r: r["fp32"]),
                       *((f"dtrain {p}", lambda r, p=p: r["runs"][p]) for p in precisions)):
        picked = [pick(r) for r in rows]
        print(f"| {name} | {spread([x['steady'] for x in picked])} | "
              f"{spread([max(x['involuntary_switches'], 1) for x in picked], ',.0f')} |")
    hosts = [r["host_before"] for r in rows] + [r["host_after"] for r in rows]
    print(f"| host probe, us per Python iteration | {spread([h['python_us'] for h in hosts], '.4f')} | - |")
    print(f"| host probe, us per tiny tensor op | {spread([h['tensor_op_us'] for h in hosts], '.3f')} | - |")
    print("\n| precision | predicted (median of rounds) | measured gain (median) | error | "
          "same-round pairs within 20% | all pairs within 20% | own probe / own step |")
    print("|---|---|---|---|---|---|---|")
    for p in precisions:
        predicted = [(r["fp32"].get("doctor", {}).get(p) or {}).get("gain") for r in rows]
        same = [(g, r["runs"][p]["steady"] / r["fp32"]["steady"]) for g, r in zip(predicted, rows, strict=True) if g]
        every = [(g, a["runs"][p]["steady"] / b["fp32"]["steady"])
                 for (g, b), a in itertools.product(zip(predicted, rows, strict=True), rows) if g]
        measured = statistics.median(r["runs"][p]["steady"] for r in rows) / statistics.median(
            r["fp32"]["steady"] for r in rows)
        point = statistics.median(g for g, _ in same) if same else None
        own = [r["runs"][p]["probe_ms"] / r["runs"][p]["step_ms"] for r in rows
               if r["runs"][p]["probe_ms"] > 0 and r["runs"][p]["step_ms"] > 0]

        def within(pairs: list[tuple[float, float]]) -> str:
            return f"{sum(abs(g / m - 1) <= 0.2 for g, m in pairs)} of {len(pairs)}" if pairs else "-"

        error = "-" if point is None else f"{100 * (point / measured - 1):+.1f}%"
        print(f"| {p} | {'-' if point is None else f'{point:.2f}x'} | {measured:.2f}x | {error} | "
              f"{within(same)} | {within(every)} | {spread(own, '.3f')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=330.0, help="start no round that would end past this")
    parser.add_argument("--max-rounds", type=int, default=6)
    parser.add_argument("--precisions", default="bf16-mixed,16-mixed,tf32")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke-on-cpu", action="store_true", help="check the script on a CPU (no fp16)")
    parser.add_argument("--pinned", action="store_true",
                        help="pin this process, and so every process it starts, to one core (the plain loop "
                             "pinned ran 1.0-1.35x as fast as free on an H200 host: is dtrain's spread placement?)")
    parser.add_argument("--table", type=Path, nargs="+", default=None,
                        help="print the summary of stored --json files, their rounds pooled (calls of one card)")
    args = parser.parse_args()
    if args.table is not None:
        stored = [json.loads(path.read_text()) for path in args.table]
        precisions = stored[0]["args"]["precisions"].strip("[]").replace("'", "").replace(" ", "").split(",")
        summarize([row for one in stored for row in one["rows"]], precisions)
        return
    args.precisions = args.precisions.split(",")
    unknown = set(args.precisions) - set(BASELINE) | ({"32-true"} & set(args.precisions))
    if unknown:
        sys.exit(f"--precisions: {sorted(unknown)} unknown or the baseline; choose among tf32, bf16-mixed, 16-mixed")
    device = "cpu" if args.smoke_on_cpu else "cuda:0"
    if args.smoke_on_cpu and "16-mixed" in args.precisions:
        sys.exit("--smoke-on-cpu: 16-mixed needs a GPU")
    args.plain = "bf16"
    cores = sorted(os.sched_getaffinity(0))
    core = cores[len(cores) // 2]
    if args.pinned:
        os.sched_setaffinity(0, {core})
    rows: list[dict[str, Any]] = []
    begin, longest = time.monotonic(), 0.0
    with tempfile.TemporaryDirectory() as tmp:
        while len(rows) < args.max_rounds and time.monotonic() - begin + longest <= args.seconds:
            start = time.monotonic()
            rows.append(one_round(args, device, core, Path(tmp)))
            longest = max(longest, time.monotonic() - start)
            print_round(len(rows) - 1, rows[-1], args.precisions)
            if args.json is not None:
                args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                 "pinned_core": core, "cores": len(cores), "rows": rows}, indent=2))
    if rows:
        summarize(rows, args.precisions)


if __name__ == "__main__":
    main()
