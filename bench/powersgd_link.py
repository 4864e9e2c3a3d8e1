#!/usr/bin/env python3
"""Where PowerSGD's time goes on a slow link: 2 test hosts x 1 slot over tc tbf (root; see
scripts/testhosts.py), the 9.7M-parameter MLP of bench/optimizations.py, dtrain's PowerSGD hook.

    .venv/bin/python bench/powersgd_link.py [--rate 200mbit] [--steps 12] [--reps 15]

1. Training steps with the hook (DDP, bucket = optimizations.tensor_fusion_threshold's default): per step
   the number and sizes of the all-reduces the hook issues, the seconds spent inside them, and the hook's
   own compute (power iteration, QR, error feedback) = hook time minus all-reduce time.
2. The same all-reduce sizes alone on the link, each after a barrier: back to back (link busy a moment
   ago) and after ``--idle-ms`` of computation with no traffic (as after forward/backward in training).
3. The compression compute alone on one core (no communication): the hook's math timed in isolation.

Prints a Markdown table per part.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
# DTRAIN_SRC: time another checkout's hook (e.g. an old commit in a temporary worktree) with this script.
SRC = Path(os.environ.get("DTRAIN_SRC", ROOT / "src"))
sys.path.insert(0, str(SRC))

HIDDEN = 3072
BATCH = 32


def _model() -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, 10))


class _Calls:
    """Wraps ``torch.distributed.all_reduce`` so every call from Python is logged with its wait time."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.original = dist.all_reduce
        self.log: list[tuple[int, float]] = []  # (bytes, seconds blocked in the call or its wait())
        dist.all_reduce = self._all_reduce  # type: ignore[assignment]

    def _all_reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        start = time.perf_counter()
        work = self.original(tensor, *args, **kwargs)
        spent = time.perf_counter() - start
        if not kwargs.get("async_op"):
            self.log.append((nbytes, spent))
            return work
        calls = self

        class _Timed:
            def wait(self) -> Any:
                t0 = time.perf_counter()
                out = work.wait()
                calls.log.append((nbytes, spent + time.perf_counter() - t0))
                return out

        return _Timed()


def _hook_steps(steps: int, start_iteration: int, bucket_view: bool) -> dict[str, Any]:
    """Part 1: train ``steps`` steps with dtrain's PowerSGD hook; per-step logs after warm-up."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dtrain.sync.powersgd import PowerSGDState, powersgd_hook

    torch.manual_seed(0)
    model = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=64.0, gradient_as_bucket_view=bucket_view)
    state = PowerSGDState(model, rank=4, start_iteration=start_iteration, error_feedback=True, warm_start=True)
    hook_seconds: list[float] = []

    # No annotations: DDP checks them at runtime and this module's are strings.
    def timed_hook(s, bucket):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        fut = powersgd_hook(s, bucket)
        hook_seconds.append(time.perf_counter() - t0)
        return fut

    ddp.register_comm_hook(state, timed_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    calls = _Calls()
    x = torch.randn(BATCH, 64)
    y = torch.randint(0, 10, (BATCH,))
    rows = []
    for step in range(steps):
        calls.log.clear()
        hook_seconds.clear()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # as dtrain's context does
        total = time.perf_counter() - t0
        if step >= start_iteration + 2:
            rows.append({"step": total, "hook": sum(hook_seconds), "buckets": len(hook_seconds),
                         "allreduces": [b for b, _ in calls.log], "allreduce_seconds": [s for _, s in calls.log]})
    dist.all_reduce = calls.original  # type: ignore[assignment]
    return {"rows": rows}


def _sizes_alone(sizes: list[int], reps: int, idle_ms: float) -> dict[str, list[float]]:
    """Part 2: the hook's all-reduce sizes in sequence, after a barrier, back to back vs after idling."""
    import torch
    import torch.distributed as dist

    tensors = [torch.ones(n // 4) for n in sizes]
    a = torch.randn(HIDDEN, HIDDEN)
    out: dict[str, list[float]] = {"back_to_back": [], "after_compute": []}
    for t in tensors:
        dist.all_reduce(t)  # warm-up
    for _ in range(reps):
        for mode in out:
            dist.barrier()
            if mode == "after_compute":
                # No traffic for idle_ms (computation, as in forward/backward), then the same barrier-free start
                # on both ranks: a second barrier would itself send packets and end the idle period.
                deadline = time.perf_counter() + idle_ms / 1e3
                while time.perf_counter() < deadline:
                    a @ a[:, :8]
            t0 = time.perf_counter()
            for t in tensors:
                dist.all_reduce(t)
            out[mode].append(time.perf_counter() - t0)
        for t in tensors:  # each size on its own, link just used
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            out.setdefault(f"one {t.numel() * 4} B", []).append(time.perf_counter() - t0)
    return out


def _compression_alone(reps: int) -> list[float]:
    """Part 3: the hook's per-step math on this core without communication (world of one)."""
    import torch

    from dtrain.sync import powersgd

    if not hasattr(powersgd, "_compress_and_average"):
        return [float("nan")]  # an old checkout: the math is inline in its hook
    model = _model()
    state = powersgd.PowerSGDState(model, rank=4, start_iteration=0, error_feedback=True, warm_start=True)
    grads = [(i, torch.randn_like(p).view(p.shape[0], -1)) for i, p in enumerate(model.parameters()) if p.dim() > 1]
    plain = [torch.randn_like(p) for p in model.parameters() if p.dim() < 2]
    # Since the fix the bucket's vectors travel with P: the function takes them too.
    fused = len(inspect.signature(powersgd._compress_and_average).parameters) == 4
    saved = powersgd.dist.all_reduce
    powersgd.dist.all_reduce = lambda *a, **k: None  # type: ignore[assignment]
    try:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if fused:
                powersgd._compress_and_average(state, grads, plain, 1)
            else:
                powersgd._compress_and_average(state, grads, 1)
            times.append(time.perf_counter() - t0)
    finally:
        powersgd.dist.all_reduce = saved  # type: ignore[assignment]
    return times


def worker(rank: int, master: str, steps: int, reps: int, idle_ms: float, bucket_view: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=2)
    result: dict[str, Any] = {"hook": _hook_steps(steps, start_iteration=2, bucket_view=bucket_view)}
    sizes = result["hook"]["rows"][-1]["allreduces"]
    result["sizes"] = sizes
    result["alone"] = _sizes_alone(sizes, reps, idle_ms)
    dist.barrier()
    dist.destroy_process_group()
    result["compression"] = _compression_alone(reps)
    if rank == 0:
        print(json.dumps(result), flush=True)


def _ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):.1f} ms ({1e3 * min(values):.1f}-{1e3 * max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="driver", choices=["driver", "worker"])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--master", default="")
    parser.add_argument("--rate", default="200mbit", help="tbf rate of each host's link; none: unthrottled")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--idle-ms", type=float, default=300.0, help="computation without traffic before "
                        "the all-reduces in part 2 (default 300: above Linux's 200 ms minimum RTO)")
    parser.add_argument("--bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
    args = parser.parse_args(argv)
    if args.mode == "worker":
        worker(args.rank, args.master, args.steps, args.reps, args.idle_ms, args.bucket_view)
        return 0
    from link import PORT, _run_pair
    from testhosts import TestHosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"bench/powersgd_link.py: {reason}", file=sys.stderr)
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": str(SRC)}
    with TestHosts(2, rate=None if args.rate == "none" else args.rate, pin_cpus=True) as hosts:
        master = f"{hosts.hosts[0].address}:{PORT}"

        def argv_for(i: int) -> list[str]:
            return [sys.executable, str(Path(__file__).resolve()), "worker", "--rank", str(i), "--master", master,
                    "--steps", str(args.steps), "--reps", str(args.reps), "--idle-ms", str(args.idle_ms),
                    *(["--bucket-view"] if args.bucket_view else [])]

        out = _run_pair(hosts, argv_for, env, timeout=900)[0].stdout
    res = json.loads(out.strip().splitlines()[-1])
    rows = res["hook"]["rows"]
    print(f"## PowerSGD rank 4 on 2 hosts, link {args.rate}: {len(rows)} steps after warm-up (rank 0)")
    print(f"buckets per step: {rows[-1]['buckets']}; all-reduces per step: {len(rows[-1]['allreduces'])}, "
          f"bytes {rows[-1]['allreduces']} (sum {sum(rows[-1]['allreduces']) / 1e6:.3f} MB)")
    print("| | median (min-max) |")
    print("|---|---|")
    print(f"| step | {_ms([r['step'] for r in rows])} |")
    print(f"| in the hook | {_ms([r['hook'] for r in rows])} |")
    print(f"| in all-reduces (hook) | {_ms([sum(r['allreduce_seconds']) for r in rows])} |")
    print(f"| hook compute (hook - all-reduces) | {_ms([r['hook'] - sum(r['allreduce_seconds']) for r in rows])} |")
    for k in range(len(rows[-1]["allreduces"])):
        print(f"| all-reduce {k} ({rows[-1]['allreduces'][k]} B) | {_ms([r['allreduce_seconds'][k] for r in rows])} |")
    print(f"\n## The same all-reduces alone on the link ({args.reps} reps, after a barrier)")
    print(f"| back to back | {_ms(res['alone']['back_to_back'])} |")
    print(f"| after {args.idle_ms:.0f} ms of compute, no traffic | {_ms(res['alone']['after_compute'])} |")
    for key, values in res["alone"].items():
        if key.startswith("one "):
            print(f"| {key[4:]} alone | {_ms(values)} |")
    print(f"\n## Compression compute alone, one core, no communication: {_ms(res['compression'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
