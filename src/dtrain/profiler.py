"""Per-step time breakdown: where does a training step's time go?

Phases of a step, on every rank:

* ``data``         waiting for the next batch (loader + host-to-device copy)
* ``forward``      from the batch to ``context.backward(loss)``
* ``backward``     backward *compute*: until the last gradient bucket is ready
* ``comm_exposed`` the rest of ``backward()``: waiting for gradient all-reduces that did not overlap
* ``optimizer``    ``context.step_optimizer``
* ``other``        everything else in ``train_batch``

DDP overlaps each bucket's all-reduce with the rest of backward, so communication is measured twice:
*exposed* (above) and *busy* (the union of every bucket's launch-to-completion interval, from a comm-hook
wrapper), with the bytes all-reduced. The last bucket's hook fires when the last gradient is computed,
which is where backward compute ends and exposed waiting begins.

On CPU a monotonic clock is exact. On CUDA the device is synchronized at phase edges (only there) so that
kernels are charged to the phase that launched them; hook times are host-side on CUDA.
"""

# No "from __future__ import annotations": DDP checks the comm hook's annotations at runtime.

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

PHASES = ("data", "forward", "backward", "comm_exposed", "optimizer", "other")
COMM_FIELDS = ("comm_busy", "comm_bytes", "comm_buckets")


class CommRecorder:
    """What the gradient all-reduces of the current step did: launch/completion times and bytes.

    ``native``, when set, is a source of communication averages measured by the framework itself (DDP's
    reducer timers), used instead of per-step stamps: see :meth:`StepTimer.per_step`.
    """

    __slots__ = ("bytes", "completions", "grad_ready", "launches", "native")

    def __init__(self) -> None:
        self.launches: list[float] = []
        self.completions: list[float] = []
        self.bytes = 0
        # With native timing: when the last gradient of this step was computed (an autograd hook on the
        # main thread, no Python on the communication thread).
        self.grad_ready = 0.0
        self.native: Callable[[], dict[str, float] | None] | None = None

    def mark_grad_ready(self, *_: Any) -> None:
        self.grad_ready = max(self.grad_ready, time.perf_counter())

    def reset(self) -> None:
        self.launches = []
        self.completions = []
        self.bytes = 0
        self.grad_ready = 0.0

    def busy_seconds(self, lo: float = float("-inf"), hi: float = float("inf")) -> float:
        """Length of the union of [launch, completion] intervals (buckets can be in flight together),
        clipped to [lo, hi]."""
        spans = sorted(zip(self.launches, self.completions, strict=False))
        busy, end = 0.0, lo
        for start, stop in spans:
            stop = min(stop, hi)
            if stop <= end:
                continue
            busy += stop - max(start, end)
            end = stop
        return busy


class TimedHookState:
    """State for :func:`timed_comm_hook`: the wrapped hook, its own state, and the recorder."""

    __slots__ = ("inner_hook", "inner_state", "recorder")

    def __init__(self, inner_hook: Callable[..., Any], inner_state: Any, recorder: CommRecorder) -> None:
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.recorder = recorder


def timed_comm_hook(state: TimedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook that runs ``state.inner_hook`` and stamps when each bucket starts and finishes.

    The stamp is chained onto the inner future, so DDP (which waits on the returned future before
    ``backward()`` returns) never sees a bucket as done before its completion time is recorded.
    """
    recorder = state.recorder
    recorder.launches.append(time.perf_counter())
    buffer = bucket.buffer()
    recorder.bytes += buffer.numel() * buffer.element_size()

    def stamp(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        recorder.completions.append(time.perf_counter())
        return fut.value()

    return state.inner_hook(state.inner_state, bucket).then(stamp)


def timed_allreduce_hook(recorder: CommRecorder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default behaviour (average by all-reduce) with the bucket's launch and completion stamped.

    Equivalent to wrapping torch's ``allreduce_hook`` in :func:`timed_comm_hook`, with one future callback
    instead of two: this hook runs for every bucket of every step, so the profiler's cost lives here.
    """
    buffer = bucket.buffer()
    recorder.launches.append(time.perf_counter())
    recorder.bytes += buffer.numel() * buffer.element_size()
    # Divide before summing, as torch's allreduce_hook does, so fp16 buffers cannot overflow.
    buffer.div_(dist.get_world_size())

    def stamp(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        recorder.completions.append(time.perf_counter())
        return fut.value()[0]

    return dist.all_reduce(buffer, async_op=True).get_future().then(stamp)


class StepTimer:
    """Accumulates seconds per phase over the steps of a run, on one rank.

    The first ``warmup_steps`` are timed as steps (for samples/s) but left out of the phase statistics:
    they include one-off costs (DDP's first-iteration bucket rebuild, allocator warm-up).
    """

    def __init__(self, device: torch.device, enabled: bool = True, warmup_steps: int = 3) -> None:
        self.enabled = enabled
        self.warmup_steps = warmup_steps
        self.recorder = CommRecorder()
        self._sync = enabled and device.type == "cuda"
        self.totals: dict[str, float] = dict.fromkeys(PHASES + COMM_FIELDS, 0.0)
        self.window: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.window_steps = 0
        self.steps = 0  # every step, warm-up included
        self.profiled_steps = 0
        self.step_seconds = 0.0  # every step, warm-up included
        self.last_step_seconds = 0.0
        self.profiled_seconds = 0.0
        self._current: dict[str, float] = {}
        self._in_step = False
        self._step_start = 0.0
        self._mark = 0.0

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start_step(self) -> None:
        self._step_start = self._mark = self._now()
        self._in_step = True
        if self.enabled:
            self._current = dict.fromkeys(PHASES, 0.0)
            self.recorder.reset()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous edge to ``phase``."""
        if not (self.enabled and self._in_step):  # own loops (dtrain.init) need not mark steps
            return
        now = self._now()
        self._current[phase] += now - self._mark
        self._mark = now

    @contextmanager
    def phase(self, name: str, before: str = "forward") -> Iterator[None]:
        """Time a block as ``name``; the gap since the last edge goes to ``before``."""
        self.lap(before)
        try:
            yield
        finally:
            self.lap(name)

    @contextmanager
    def backward(self) -> Iterator[None]:
        """Time ``loss.backward()``: exposed communication is the part of it, after the last gradient bucket
        was ready, during which an all-reduce was still in flight; the rest is backward compute (with DDP's
        own bookkeeping)."""
        self.lap("forward")
        start = self._mark
        try:
            yield
        finally:
            if self.enabled and self._in_step:
                end = self._now()
                launches = self.recorder.launches
                if launches:
                    exposed = self.recorder.busy_seconds(lo=max(start, launches[-1]), hi=end)
                elif self.recorder.native is not None and self.recorder.grad_ready > start:
                    exposed = end - min(end, self.recorder.grad_ready)  # after the last gradient: waiting
                else:
                    exposed = 0.0
                self._current["backward"] += end - start - exposed
                self._current["comm_exposed"] += exposed
                self._mark = end

    def end_step(self) -> None:
        end = self._now()
        self._in_step = False
        self.steps += 1
        self.last_step_seconds = end - self._step_start
        self.step_seconds += self.last_step_seconds
        if not self.enabled:
            return
        self._current["other"] += end - self._mark
        self._mark = end
        if self.steps <= self.warmup_steps:
            return
        self.profiled_steps += 1
        self.profiled_seconds += end - self._step_start
        for phase, seconds in self._current.items():
            self.totals[phase] += seconds
            self.window[phase] += seconds
        self.window_steps += 1
        self.totals["comm_busy"] += self.recorder.busy_seconds()
        self.totals["comm_bytes"] += self.recorder.bytes
        self.totals["comm_buckets"] += len(self.recorder.launches)

    def per_step(self) -> dict[str, float]:
        """Mean per profiled step: seconds for each phase and ``step``, bytes and buckets for comm."""
        n = max(1, self.profiled_steps)
        out = {key: value / n for key, value in self.totals.items()}
        out["step"] = self.profiled_seconds / n
        native = self.recorder.native() if self.recorder.native is not None else None
        if native is not None:
            # Busy time, bytes and buckets from DDP's own timers; exposed time (after the last gradient) from
            # this step's stamps, bounded by the busy time (the rest is DDP's bookkeeping: backward).
            exposed = min(out["comm_exposed"], native["busy"])
            out.update(backward=out["backward"] + out["comm_exposed"] - exposed, comm_exposed=exposed,
                       comm_busy=native["busy"], comm_bytes=native["bytes"], comm_buckets=native["buckets"])
        return out

    def take_window(self) -> dict[str, float]:
        """Mean seconds per phase since the previous call (for periodic TensorBoard scalars)."""
        n = self.window_steps
        out = {p: s / n for p, s in self.window.items()} if n else {}
        self.window = dict.fromkeys(PHASES, 0.0)
        self.window_steps = 0
        return out


# ------------------------------------------------------------------------------------- across ranks

RANK_FIELDS = (*PHASES, "step", *COMM_FIELDS, "peak_memory_bytes", "state_bytes")


def peak_memory_bytes(device: torch.device) -> float:
    """Peak memory of this rank: the CUDA allocator's peak on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _local_numel_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP's DTensor shards
    return local.numel() * local.element_size()


def state_bytes(models: list[Any], optimizers: list[Any]) -> float:
    """Bytes of parameters and optimizer state this rank holds (1/N of DDP's under FSDP)."""
    total = sum(_local_numel_bytes(p) for m in models for p in m.parameters())
    for opt in optimizers:
        for state in opt.state.values():
            total += sum(_local_numel_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    return float(total)


def latency_probe(repeats: int = 10, group: Any = None) -> float:
    """Median time of an all-reduce of one float: the per-message cost, independent of bandwidth."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return 0.0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    one = torch.zeros(1, device=device)
    dist.all_reduce(one, group=group)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(one, group=group)
        if device is not None:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def gather_rank_stats(timer: StepTimer, memory: dict[str, float], group: Any = None) -> list[dict[str, float]]:
    """Every rank's per-step means and ``memory`` figures, gathered on all ranks of ``group`` (one small
    all_gather)."""
    mine = {**timer.per_step(), **memory}
    values = torch.tensor([mine[f] for f in RANK_FIELDS], dtype=torch.float64)
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [dict(zip(RANK_FIELDS, values.tolist(), strict=True))]
    if dist.get_backend(group) == "nccl":
        values = values.cuda()
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, values, group=group)
    return [dict(zip(RANK_FIELDS, g.cpu().tolist(), strict=True)) for g in gathered]


def build_profile(per_rank: list[dict[str, float]], hosts: list[str], run: dict[str, Any],
                  latency_seconds: float) -> dict[str, Any]:
    """The ``profile.json`` document (schema in docs/profile.md)."""
    slots = len(per_rank)
    spread = {
        field: {"min": min(r[field] for r in per_rank), "mean": sum(r[field] for r in per_rank) / slots,
                "max": max(r[field] for r in per_rank)}
        for field in (*PHASES, "step")
    }
    comm_bytes = sum(r["comm_bytes"] for r in per_rank) / slots
    busy = sum(r["comm_busy"] for r in per_rank) / slots
    algbw = comm_bytes / busy if busy > 0 else 0.0
    return {
        "schema_version": 1,
        **run,
        "phases": list(PHASES),
        "seconds_per_step": spread,
        "per_rank": [
            {"rank": i, "host": hosts[i] if i < len(hosts) else "",
             "seconds_per_step": {f: r[f] for f in (*PHASES, "step")},
             "comm_busy_seconds_per_step": r["comm_busy"], "comm_bytes_per_step": r["comm_bytes"],
             "comm_buckets_per_step": r["comm_buckets"], "peak_memory_bytes": r["peak_memory_bytes"],
             "state_bytes": r["state_bytes"]}
            for i, r in enumerate(per_rank)
        ],
        "comm": {
            "bytes_per_step": comm_bytes,
            "buckets_per_step": sum(r["comm_buckets"] for r in per_rank) / slots,
            "busy_seconds_per_step": busy,
            "exposed_seconds_per_step": spread["comm_exposed"]["mean"],
            "algbw_bytes_per_second": algbw,
            # A ring all-reduce moves 2(N-1)/N of the buffer through each link: the link's achieved rate.
            "busbw_bytes_per_second": algbw * 2 * (slots - 1) / slots if slots > 1 else 0.0,
            "latency_seconds": latency_seconds,
        },
    }


def collect_rank_figures(ctx: Any) -> tuple[list[dict[str, float]], float, list[str]]:
    """End of a run, on every rank of a DistributedContext: per-rank step figures and memory (training
    slots), the all-reduce latency probe, and every rank's host name. Collectives: all ranks call it."""
    group = ctx.strategy.dp_group
    memory = {"peak_memory_bytes": peak_memory_bytes(ctx.device),
              "state_bytes": state_bytes(ctx.models, ctx.optimizers)}
    per_rank = gather_rank_stats(ctx.timer, memory, group)
    latency = latency_probe(group=group)
    from dtrain.dist import all_hostnames

    return per_rank, latency, all_hostnames()
