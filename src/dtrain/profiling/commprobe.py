"""The link's latency and bandwidth: all-reduces of several sizes, fitted to ``seconds = a + bytes / rate``.

One size says nothing about where a message's cost comes from: a few KB cost the per-message latency
(waking a thread, a round trip per ring step), tens of MB the bandwidth. The cost model
(:mod:`dtrain.explain.costmodel`) needs both to price another world size, another bucket layout or
compressed gradients, so every multi-slot run ends with this probe on its own backend and interface, and
``dtrain plan --probe`` runs it in local processes for a run that had one slot (which measured no link).

Each size runs back to back after a warm-up, ``REPEATS`` times; the lower quartile counts (:data:`QUANTILE`).
The fit is least squares on relative error (a 4 KB point weighs as much as a 32 MB one), both terms at least
zero.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain import dist as ddist
from dtrain.profiling.buckets import gradient_bytes, layout
from dtrain.profiling.probeguard import ProbeGuard

# From a few KB (latency-bound) to tens of MB (bandwidth-bound), and the gradients' own size in between.
SIZES = (4 * 2**10, 64 * 2**10, 2**20, 8 * 2**20, 32 * 2**20)
REPEATS = 11
# fp16 all-reduces (as the fp16 and bf16 compression hooks send them): Gloo sums 16-bit floats element by element
# on the CPU, so on a fast link half the bytes take about as long as all of them (2026-12-02, digits-sized to 8 MB).
HALF_SIZES = (64 * 2**10, 2**20, 8 * 2**20)
HALF_REPEATS = 5
# The share of a size's repeats faster than the time that counts. On a shared VM a slow spell (a peer off its
# core) can span most of a size's back-to-back repeats, and a median then reads it in one probe and not the next
# (several times apart at the small sizes); the least time is no steadier at the large ones (docs/benchmarks.md,
# "The link probe's repeatability"). The link's shape (latency against rate) is what the fit needs; the spells a
# training's exchanges meet are in the exchange cost calibrated on the run itself (dtrain.explain.costmodel).
QUANTILE = 0.25
PROBE_FILE = "comm_probe.json"
# Fresh processes a local probe gets before it gives up: one that dies (a native thread's abort) is rare.
PROBE_ATTEMPTS = 2
# The stand-in's DDP steps: a synced step's time is skewed (now and then a rank waits for its peer's lost time
# slice), so the mean of 200 steps moved by +/-22% between probes of one host (digits' size, 2 processes on 2
# cores); 1,000 by +/-9%. Steps are added up to the most while they fit the budget, in seconds of stepping.
MOST_STEPS = 1000
STEPS_BUDGET_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class LinkFit:
    """``seconds(nbytes) = latency + nbytes / rate`` for an all-reduce on ``world`` ranks."""

    latency: float
    rate: float  # bytes of buffer per second (algorithm bandwidth)
    residual: float  # relative RMS error of the fit over the probed sizes

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.rate


def fit(points: list[tuple[float, float]]) -> LinkFit:
    """Least squares on relative error of ``(bytes, seconds)`` points; both terms kept >= 0."""
    if not points:
        raise ValueError("no probe points")
    if len(points) == 1:
        nbytes, seconds = points[0]
        return LinkFit(0.0, nbytes / seconds, 0.0)
    # Minimize sum(((a + b x) / y - 1)^2): weighted least squares with weights 1 / y^2.
    w = [1.0 / (y * y) for _, y in points]
    sw, sx = sum(w), sum(wi * x for wi, (x, _) in zip(w, points, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points, strict=True))
    sy = sum(wi * y for wi, (_, y) in zip(w, points, strict=True))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, points, strict=True))
    det = sw * sxx - sx * sx
    a, b = ((sy * sxx - sx * sxy) / det, (sw * sxy - sx * sy) / det) if det > 0 else (0.0, 0.0)
    if b <= 0:  # bandwidth not resolved: the largest point sets it
        x, y = max(points)
        a, b = 0.0, y / x
    if a < 0:  # no latency resolved: the rate through the origin
        a = 0.0
        b = sum(wi * x * y for wi, (x, y) in zip(w, points, strict=True)) / sxx
    residual = (sum(((a + b * x) / y - 1) ** 2 for x, y in points) / len(points)) ** 0.5
    return LinkFit(a, 1.0 / b, residual)


def measure(group: Any = None, sizes: tuple[int, ...] = SIZES, repeats: int = REPEATS,
            dtype: torch.dtype = torch.float32, buffer: torch.Tensor | None = None) -> list[tuple[float, float]]:
    """``(bytes, seconds)`` per size, the lower quartile of ``repeats``, on every rank of ``group`` (collective:
    all ranks call it)."""
    return [(float(nbytes), lower_quartile(times))
            for nbytes, times in repeat_times(group, sizes, repeats, dtype, buffer)]


def probe_buffer(group: Any = None, sizes: tuple[int, ...] = SIZES, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The buffer the probe all-reduces views of: the largest size, on the backend's device."""
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else None)
    return torch.zeros(max(sizes) // (torch.finfo(dtype).bits // 8), device=device, dtype=dtype)


def repeat_times(group: Any = None, sizes: tuple[int, ...] = SIZES, repeats: int = REPEATS,
                 dtype: torch.dtype = torch.float32,
                 buffer: torch.Tensor | None = None) -> list[tuple[int, list[float]]]:
    """Every repeat's seconds per size, each all-reduce after a barrier (collective: all ranks call it), in
    ``buffer`` where given (:func:`probe_buffer`)."""
    buffer = probe_buffer(group, sizes, dtype) if buffer is None else buffer
    device = buffer.device if buffer.device.type == "cuda" else None
    width = torch.finfo(dtype).bits // 8
    for _ in range(3):  # the backend's threads wake up from the run (or the start)
        dist.all_reduce(buffer[:1024], group=group)
    out = []
    for nbytes in sizes:
        view = buffer[: nbytes // width]
        dist.all_reduce(view, group=group)  # warm-up: the size's first message sets up its buffers
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(view, group=group)
            if device is not None:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        out.append((nbytes, times))
    return out


def lower_quartile(times: list[float]) -> float:
    """The time a :data:`QUANTILE` share of ``times`` beat (of 11: the third fastest; of 5: the second)."""
    return sorted(times)[int(len(times) * QUANTILE)]


def measure_half(group: Any = None, buffer: torch.Tensor | None = None) -> list[tuple[float, float]]:
    """:func:`measure` of fp16 all-reduces at :data:`HALF_SIZES` (bytes as sent)."""
    return measure(group, HALF_SIZES, HALF_REPEATS, torch.float16, buffer)


def end_of_run(group: Any, guard: ProbeGuard) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The probe at the end of a multi-slot run: fp32 points, then fp16 ones (both empty on one slot, or where
    ``guard`` skipped it). Its buffers are made first, a stage of their own: a rank that cannot make them (out of
    memory) skips the probe with every other rank, rather than leave them in its all-reduces."""
    if not ddist.is_distributed(group):
        return [], []
    # The all-reduces themselves: the same sizes on every rank, and nothing rank-local between them to fail.
    return guard.run_collective(
        "comm_probe", lambda: (probe_buffer(group), probe_buffer(group, HALF_SIZES, torch.float16)),
        lambda buffers: (measure(group, buffer=buffers[0]), measure_half(group, buffers[1])), ([], []))


# ------------------------------------------------------------------ local processes (dtrain plan --probe)
def _stand_in(parameters: int) -> torch.nn.Module:
    """Linear layers holding about ``parameters`` parameters: DDP buckets them as it would the model's."""
    width = int(min(256, max(8, math.sqrt(parameters))))
    layers = max(1, round(parameters / (width * width + width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _worker(rank: int, world: int, port: int, threads: int, parameters: int, cap_mb: float | None, steps: int,
            budget: float, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        points, half = measure(), measure_half()
        # Exchanges as training makes them: DDP on a stand-in of the model's size, steps with and without
        # gradient sync in alternating blocks; the difference of their means is what an exchange costs a step
        # (hooks, buckets, waking up, waiting for the peer) beside the all-reduces themselves.
        model = DistributedDataParallel(_stand_in(parameters), bucket_cap_mb=cap_mb)
        width = model.module[0].in_features
        batch = torch.randn(32, width)
        seconds: dict[bool, list[float]] = {True: [], False: []}

        def step(sync: bool) -> float:
            start = time.perf_counter()
            with contextlib.nullcontext() if sync else model.no_sync():
                model(batch).sum().backward()
            for p in model.parameters():
                p.grad = None
            return time.perf_counter() - start

        def run_pairs(pairs: int) -> None:  # a pair: 10 steps with gradient sync, then 10 without
            for block in range(2 * pairs):
                sync = block % 2 == 0
                seconds[sync] += [step(sync) for _ in range(10)]

        for _ in range(10):  # warm-up: DDP rebuilds its buckets after the first step
            step(True)
        pairs = max(1, steps // 20)
        start = time.perf_counter()
        run_pairs(pairs)
        run_pairs(_more_pairs(pairs, time.perf_counter() - start, budget))
        if rank == 0:
            synced, alone = statistics.mean(seconds[True]), statistics.mean(seconds[False])
            Path(out).write_text(json.dumps({"points": points, "half_points": half,
                                             "exchange_seconds": max(0.0, synced - alone),
                                             "compute_seconds": alone,
                                             "steps": len(seconds[True]) + len(seconds[False])}))
        dist.barrier()  # rank 0 serves the store: it leaves once every rank is done with it
    finally:
        dist.destroy_process_group()
    # Past the interpreter's teardown, which Gloo's and DDP's native threads were seen to race: a finished probe
    # process aborted ("terminate called without an active exception"), as dtrain's workers once did.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _more_pairs(pairs: int, elapsed: float, budget: float) -> int:
    """Pairs of blocks to add after ``pairs`` took ``elapsed`` seconds here, the same on every rank (the
    slowest rank's pace: each rank's DDP steps must match): up to :data:`MOST_STEPS` within ``budget``."""
    slowest = torch.tensor([elapsed / pairs], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    pace = max(float(slowest), 1e-9)
    fit = int((budget - pace * pairs) / pace)  # from the agreed pace alone: each rank's own elapsed differs
    return max(0, min(MOST_STEPS // 20 - pairs, fit))


@dataclass(frozen=True, slots=True)
class LocalProbe:
    """:func:`probe_local`'s result: all-reduce ``(bytes, seconds)`` points, and the mean seconds a DDP step of
    a stand-in of the model's size spends exchanging its ``buckets`` of gradients (beside ``compute_seconds`` of
    work)."""

    world: int
    threads: int
    points: list[tuple[float, float]]
    buckets: list[float]
    compute_seconds: float
    exchange_seconds: float
    steps: int = 0  # the stand-in's DDP steps timed, half with gradient sync (0: a file from before it was kept)
    half_points: list[tuple[float, float]] = field(default_factory=list)  # fp16 all-reduces (empty: older files)

    def overhead(self) -> float:
        """What an exchange in training costs beyond back-to-back all-reduces of its buckets."""
        link = fit(self.points)
        return self.exchange_seconds - sum(link.seconds(b) for b in self.buckets)


def probe_local(world: int, threads: int, parameters: int, cap_mb: float | None, steps: int = 200,
                timeout: float = 120.0, budget: float = STEPS_BUDGET_SECONDS) -> LocalProbe:
    """All-reduces among ``world`` processes on this host over loopback (Gloo), as local slots would talk,
    each with ``threads`` torch threads as the launcher would give it: several sizes back to back, then
    ``steps`` DDP steps of a stand-in with ``parameters`` parameters, bucketed at the run's ``cap_mb`` (and
    more, up to :data:`MOST_STEPS`, where they fit ``budget`` seconds of stepping)."""
    with torch.device("meta"):  # its tensors' sizes only: a big model's stand-in is not allocated here
        stand_in = _stand_in(parameters)
    buckets = [float(b) for b in layout(gradient_bytes([stand_in])[0], cap_mb)]
    failures = []
    for _ in range(PROBE_ATTEMPTS):
        try:
            result = _probe_once(world, threads, parameters, cap_mb, steps, timeout, budget)
        except ProbeDied as exc:  # another pair of fresh processes, once (a hang is not tried again)
            failures.append(str(exc))
            continue
        return LocalProbe(world, threads, _points(result["points"]), buckets,
                          float(result["compute_seconds"]), float(result["exchange_seconds"]),
                          int(result.get("steps", 0)), _points(result.get("half_points", [])))
    raise ProbeFailed(f"the local all-reduce probe of {world} processes failed {len(failures)} times ("
                      f"{'; '.join(failures)}); run it again, or give the link with --link RATE,LATENCY")


class ProbeFailed(RuntimeError):
    """A local probe's process died or hung before it gave its figures."""


class ProbeDied(ProbeFailed):
    """A local probe's process ended before it gave its figures (tried again once)."""


def _probe_once(world: int, threads: int, parameters: int, cap_mb: float | None, steps: int,
                timeout: float, budget: float) -> dict[str, Any]:
    """One attempt of :func:`probe_local` in ``world`` fresh processes: rank 0's figures."""
    import tempfile

    import torch.multiprocessing as mp

    held = ddist.hold_port()  # until rank 0's store listens on it: see hold_port
    if held is None:
        raise ProbeFailed("no free local port for the all-reduce probe; give the link with --link RATE,LATENCY")
    with tempfile.TemporaryDirectory() as tmp, contextlib.closing(held):
        out = os.path.join(tmp, "probe.json")
        args = (world, held.getsockname()[1], threads, parameters, cap_mb, steps, budget, out)
        ctx = mp.start_processes(_worker, args=args, nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise ProbeFailed(f"the local all-reduce probe of {world} processes took over {timeout:.0f} s; "
                                      "give the link with --link RATE,LATENCY")
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
            raise ProbeDied(str(exc).splitlines()[0]) from exc
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
        return dict(json.loads(Path(out).read_text()))


def save(probe: LocalProbe, path: Path) -> None:
    """Keep a local probe beside the run (``dtrain plan`` reads it back instead of probing again)."""
    path.write_text(json.dumps({"world": probe.world, "threads": probe.threads, "host": socket.gethostname(),
                                "points": probe.points, "buckets": probe.buckets,
                                "compute_seconds": probe.compute_seconds,
                                "exchange_seconds": probe.exchange_seconds, "steps": probe.steps,
                                "half_points": probe.half_points}, indent=2))


def load(path: Path) -> LocalProbe | None:
    """A saved local probe, or None when there is none or it cannot be read (it is then probed again)."""
    try:
        d = json.loads(path.read_text())
        return LocalProbe(int(d["world"]), int(d["threads"]), _points(d["points"]),
                          [float(b) for b in d["buckets"]], float(d["compute_seconds"]), float(d["exchange_seconds"]),
                          int(d.get("steps", 0)), _points(d.get("half_points", [])))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _points(pairs: list[list[float]]) -> list[tuple[float, float]]:
    """``(bytes, seconds)`` pairs as JSON gave them back."""
    return [(float(b), float(s)) for b, s in pairs]
