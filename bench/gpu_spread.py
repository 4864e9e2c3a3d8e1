"""How much a host-bound step's time moves from one process to the next on a GPU (issue 45).

    python bench/gpu_spread.py [--processes 4] [--precision bf16] [--steps 200] [--warmup 30] [--batch 32] [--json FILE]

The doctor predicts another precision from the model's steps timed in the run's own process; the check runs
that precision in another process. On one H200, a bf16 step of bench/gpu.py's model took 15-22 ms of host
time depending on the process and the machine, where the device needed less: a prediction can be no closer
than that spread. This measures it on its own: alternately, ``--processes`` times, a fresh process running
bench/gpu.py's plain loop and a ``dtrain run`` of the same model in the same precision (profiled), each
process's steady samples/s, and for dtrain its own end-of-run probe of that precision (the step timed in
chains of 4, and the host's seconds to queue it). Round-robin, so that drift over the minutes hits both
alike. A spread across processes of one kind as wide as the doctor's misses says the misses are the host's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu import BASELINE, dtrain_run  # noqa: E402  (bench/ is not a package)

PLAIN = '''
import json, sys, torch
sys.path.insert(0, {here!r})
from gpu import plain_loop
device = torch.device({device!r})
print(json.dumps(plain_loop({variant!r}, {steps}, {warmup}, {batch}, device=device)))
'''


def plain_process(variant: str, args: argparse.Namespace, device: str) -> float:
    """The plain loop's steady samples/s in a process of its own."""
    code = PLAIN.format(here=str(HERE), device=device, variant=variant, steps=args.steps, warmup=args.warmup,
                        batch=args.batch)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=1200)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["steady"])


def spread(values: list[float], spec: str = ",.1f") -> str:
    """min / median / max and one relative standard deviation (of the logs) of a list of figures."""
    if not values:
        return "-"
    logs = [math.log(v) for v in values]
    sd = statistics.stdev(logs) if len(logs) > 1 else 0.0
    low, mid, high = (format(v, spec) for v in (min(values), statistics.median(values), max(values)))
    return f"{low} / {mid} / {high}, sd {100 * sd:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--precision", default="bf16", choices=sorted(set(BASELINE.values())))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke-on-cpu", action="store_true", help="check the script on a CPU (no fp16)")
    args = parser.parse_args()
    device = "cpu" if args.smoke_on_cpu else "cuda:0"
    if args.smoke_on_cpu and args.precision == "fp16":
        sys.exit("--smoke-on-cpu: fp16 needs a GPU")
    precision = next(name for name, plain in BASELINE.items() if plain == args.precision)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            plain = plain_process(args.precision, args, device)
            ours = dtrain_run(precision, True, False, args.steps, args.warmup, args.batch, Path(tmp))
            steps = ours.get("model_steps") or {}
            row = {"plain": plain, "dtrain": ours["steady"],
                   "dtrain_step_ms": 1e3 * ours["breakdown"].get("step", 0.0),
                   "probe_ms": 1e3 * (steps.get("seconds_per_step") or {}).get(precision, 0.0),
                   "probe_host_ms": 1e3 * (steps.get("host_seconds_per_step") or {}).get(precision, 0.0)}
            rows.append(row)
            print(f"  process pair {i}: plain {plain:,.0f} samples/s, dtrain {ours['steady']:,.0f} samples/s; "
                  f"dtrain's step {row['dtrain_step_ms']:.2f} ms, its probe {row['probe_ms']:.2f} ms "
                  f"(host {row['probe_host_ms']:.2f} ms)", flush=True)
            if args.json is not None:
                args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                                indent=2))
    print(f"\n{args.precision}, batch {args.batch}, {len(rows)} processes of each kind (min / median / max):")
    print(f"| plain loop, samples/s | {spread([r['plain'] for r in rows])} |")
    print(f"| dtrain run, samples/s | {spread([r['dtrain'] for r in rows])} |")
    print(f"| dtrain's own probe, ms per step | {spread([r['probe_ms'] for r in rows if r['probe_ms'] > 0])} |")
    ratios = [r["probe_ms"] / r["dtrain_step_ms"] for r in rows if r["probe_ms"] > 0 and r["dtrain_step_ms"] > 0]
    print(f"| its probe over its own run's step | {spread(ratios, '.3f')} |")


if __name__ == "__main__":
    main()
