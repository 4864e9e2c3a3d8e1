#!/usr/bin/env python3
"""Multi-machine link benchmark on two network-namespace test hosts (root; see scripts/testhosts.py).

1. Gloo all-reduce across the 2 hosts of 1, 16 and 64 MiB float32 tensors over a link limited to
   ``--rate`` with ``tc tbf`` (and unthrottled), against the ring all-reduce bound
   2(N-1)/N x bytes / bandwidth (N = 2 hosts; bandwidth = the tbf rate). Goal: within 1.15x.
2. Training throughput of examples/digits across the 2 hosts (1 slot each, ``dtrain run --nnodes 2``),
   throttled and not, beside the same job on 2 slots of one host. Each test host is pinned to a CPU
   of its own (taskset), as separate machines would have.

    sudo .venv/bin/python bench/link.py [--rate 200mbit] [--reps 1:20,16:5,64:3] [--json out.json]

Prints a Markdown table per part. Takes about two minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

# Timed repetitions per size (median reported): small all-reduces are short and noisier, so more.
DEFAULT_REPS = "1:20,16:5,64:3"
PORT = 29510


def _parse_reps(text: str) -> dict[int, int]:
    """``1:20,16:5,64:3`` -> {1: 20, 16: 5, 64: 3} (MiB: repetitions)."""
    return {int(k): int(v) for k, v in (item.split(":") for item in text.split(","))}


def _rate_bytes_per_second(rate: str) -> float:
    """tc's units: kbit/mbit/gbit are SI (1 mbit = 10^6 bit/s)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for suffix, scale in units.items():
        if rate.lower().endswith(suffix):
            return float(rate[: -len(suffix)]) * scale / 8
    raise SystemExit(f"cannot parse rate {rate!r}; use e.g. 200mbit")


def ring_bound_seconds(nbytes: int, nodes: int, bytes_per_second: float) -> float:
    """Time a bandwidth-optimal (ring) all-reduce needs at least: each node sends 2(N-1)/N of the data."""
    return 2 * (nodes - 1) / nodes * nbytes / bytes_per_second


# ----------------------------------------------------------------------------------------- worker side


def worker(rank: int, master: str, reps: dict[int, int]) -> None:
    """One host's half of the all-reduce timing: prints a JSON line of seconds per size (rank 0)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=2)
    results = {}
    for mib, count in reps.items():
        tensor = torch.ones(mib * 2**20 // 4)
        dist.all_reduce(tensor)  # warm-up: connections, buffers
        times = []
        for _ in range(count):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        results[mib] = times
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(results), flush=True)


# ----------------------------------------------------------------------------------------- driver side


def _run_pair(hosts, argv_for, env: dict, timeout: float) -> list[subprocess.CompletedProcess]:
    procs = [hosts.popen(i, argv_for(i), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True) for i in range(2)]
    # Output is small (summaries, one JSON line), so waiting on exit codes before reading pipes is safe.
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now  # one host failed: give the other a moment to report, then stop it
        if now > deadline or (failed_at is not None and now - failed_at > 30):
            hosts.destroy()
            break
        time.sleep(0.2)
    done = [subprocess.CompletedProcess(p.args, p.returncode, *p.communicate()) for p in procs]
    for r in done:
        if r.returncode != 0:
            raise SystemExit(f"benchmark process failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return done


def allreduce(rate: str | None, reps: str) -> dict:
    from testhosts import TestHosts

    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    with TestHosts(2, rate=rate, pin_cpus=True) as hosts:
        master = f"{hosts.hosts[0].address}:{PORT}"
        def argv(i: int) -> list[str]:
            return [sys.executable, str(Path(__file__).resolve()), "worker", "--rank", str(i), "--master", master,
                    "--reps", reps]

        out = _run_pair(hosts, argv, env, timeout=600)[0].stdout
    return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def digits(rate: str | None, tmp: Path, tag: str) -> float:
    """samples/s of examples/digits on 2 hosts x 1 slot (dtrain's multi-node launch)."""
    from testhosts import TestHosts

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run_dir = tmp / f"digits-{tag}"
    with TestHosts(2, rate=rate, pin_cpus=True) as hosts:
        def argv(i: int) -> list[str]:
            return [sys.executable, "-m", "dtrain.cli", "run", "examples/digits/experiment.yaml", "--slots", "2",
                    "--nnodes", "2", "--node-rank", str(i), "--master", f"{hosts.hostname(0)}:{PORT}",
                    "--run-dir", str(run_dir), "--quiet"]

        _run_pair(hosts, argv, env, timeout=600)
    return json.loads((run_dir / "summary.json").read_text())["samples_per_second"]


def digits_one_host(tmp: Path) -> float:
    run_dir = tmp / "digits-local"
    subprocess.run([sys.executable, "-m", "dtrain.cli", "run", "examples/digits/experiment.yaml", "--slots", "2",
                    "--run-dir", str(run_dir), "--quiet"], cwd=ROOT, check=True, capture_output=True, timeout=600)
    return json.loads((run_dir / "summary.json").read_text())["samples_per_second"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode")
    w = sub.add_parser("worker")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--master", required=True)
    w.add_argument("--reps", required=True)
    parser.add_argument("--rate", default="200mbit", help="tbf rate of each host's link (default 200mbit)")
    parser.add_argument("--reps", default=DEFAULT_REPS, help=f"MiB:timed all-reduces per size, median reported "
                        f"(default {DEFAULT_REPS})")
    parser.add_argument("--skip-training", action="store_true", help="only the all-reduce part")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    if args.mode == "worker":
        worker(args.rank, args.master, _parse_reps(args.reps))
        return 0

    from testhosts import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"bench/link.py: {reason}", file=sys.stderr)
        return 2
    bandwidth = _rate_bytes_per_second(args.rate)
    raw: dict = {"rate": args.rate, "reps": args.reps, "date": time.strftime("%Y-%m-%d")}
    throttled = allreduce(args.rate, args.reps)
    free = allreduce(None, args.reps)
    raw["allreduce"] = {"throttled": throttled, "unthrottled": free}
    print(f"## All-reduce, 2 hosts, Gloo, link {args.rate} (tbf) = {bandwidth / 1e6:.0f} MB/s")
    print("| size | ring bound | measured (throttled), median | ratio to bound | unthrottled, median | reps |")
    print("|---|---|---|---|---|---|")
    for mib in _parse_reps(args.reps):
        nbytes = mib * 2**20
        bound = ring_bound_seconds(nbytes, 2, bandwidth)
        t = statistics.median(throttled[mib])
        u = statistics.median(free[mib])
        print(f"| {mib} MiB | {1e3 * bound:.1f} ms | {1e3 * t:.1f} ms ({nbytes / t / 1e6:.1f} MB/s) | "
              f"{t / bound:.3f}x | {1e3 * u:.1f} ms | {len(throttled[mib])} |")
    if not args.skip_training:
        with tempfile.TemporaryDirectory(prefix="dtrain-link-") as tmp:
            speeds = {f"2 hosts x 1 slot (1 core each), link {args.rate}": digits(args.rate, Path(tmp), "throttled"),
                      "2 hosts x 1 slot (1 core each), unthrottled veth": digits(None, Path(tmp), "free"),
                      "1 host x 2 slots (both cores), loopback": digits_one_host(Path(tmp))}
        raw["digits_samples_per_second"] = speeds
        print("\n## examples/digits training throughput")
        print("| setup | samples/s |")
        print("|---|---|")
        for name, value in speeds.items():
            print(f"| {name} | {value:,.0f} |")
    if args.json:
        args.json.write_text(json.dumps(raw, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
