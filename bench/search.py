"""ASHA vs random search on digits: the same trials, the best validation accuracy and the batches it took.

    .venv/bin/python bench/search.py [--trials 12] [--slots 2] [--out runs/bench-search]

Runs ``dtrain search examples/digits/search.yaml`` twice with the same number of trials: once with
``searcher.name=random`` (every trial trained to max_length) and once with ``adaptive_asha`` (trials stopped
or promoted at rung ends by Optuna's successive halving). Both draw the same hyperparameters for trial n
(one seeded sampler per trial number), so they differ only in how long each trial trains. The goal: ASHA
reaches the best accuracy of random within 0.5 point with at most 50% of its batches. Accuracy and batches
do not depend on the machine's load; wall time does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def search(config: Path, name: str, trials: int, slots: int, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "dtrain.cli", "search", str(config), "--slots", str(slots), "--out", str(out),
           "--set", f"searcher.name={name}", "--set", f"searcher.max_trials={trials}"]
    for item in extra:
        cmd += ["--set", item]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=3600)
    result = json.loads((out / "trials.json").read_text())
    result["wall_seconds"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "digits" / "search.yaml")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / f"bench-search-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="extra config overrides")
    args = parser.parse_args()
    results = {}
    for name in ("random", "adaptive_asha"):
        results[name] = search(args.config, name, args.trials, args.slots, args.out / name, args.extra)
        r = results[name]
        print(f"{name}: best accuracy {100 * r['best']['value']:.2f}% (trial {r['best']['trial']}), "
              f"{r['total_batches']:,} batches, {r['wall_seconds']:.0f} s", flush=True)
    rand, asha = results["random"], results["adaptive_asha"]
    print("\n| searcher | trials | stopped early | best validation accuracy | batches trained | vs random | wall |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        stopped = sum(t["state"] == "stopped" for t in r["trials"])
        best = f"{100 * r['best']['value']:.2f}% (trial {r['best']['trial']})"
        share = r["total_batches"] / rand["total_batches"]
        print(f"| {name} | {len(r['trials'])} | {stopped} | {best} | {r['total_batches']:,} | {share:.0%} "
              f"| {r['wall_seconds']:.0f} s |")
    gap = 100 * (rand["best"]["value"] - asha["best"]["value"])
    share = asha["total_batches"] / rand["total_batches"]
    met = gap <= 0.5 and share <= 0.5
    print(f"\nASHA vs random: accuracy {gap:+.2f} point(s) below (goal <= 0.5), {share:.0%} of the batches "
          f"(goal <= 50%): {'goal met' if met else 'goal MISSED'}")
    (args.out / "bench.json").write_text(json.dumps(results, indent=2))
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
