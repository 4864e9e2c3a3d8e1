"""What the profiler knows about communication: one recorder that every strategy reports to.

Strategies never read clocks themselves. A synchronous exchange is ``with recorder.collective(nbytes):``;
an asynchronous one (a DDP comm hook whose all-reduce completes on another thread) calls
:meth:`CommRecorder.launch` and later :meth:`CommRecorder.complete`. With profiling off, strategies hold
:data:`NULL_RECORDER`, whose methods do nothing, so they need no ``if profiling`` of their own.

Plain DDP is timed from this side too (:class:`DDPTiming`), without a Python comm hook: see its doc.
"""

# No "from __future__ import annotations": DDP checks the comm hook's annotations at runtime.

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.profiling.clock import Clock, HostClock

# DDP's reducer times one iteration in this many (plus its first ten).
NATIVE_SAMPLE_RATE = 10


class CommRecorder:
    """Launch/completion times and bytes of the current step's collectives, and when the step's last
    gradient was computed (the point after which backward only waits for communication)."""

    __slots__ = ("_bytes_pending", "armed", "bytes", "clock", "completions", "grad_ready", "grad_ready_seen",
                 "launches", "native", "settle")
    enabled = True

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else HostClock()
        self.launches: list[float] = []
        self.completions: list[float] = []
        self.bytes = 0
        self._bytes_pending = 0
        # A clock stamp (float on CPU, CUDA event on GPU) set by an autograd hook when backward has computed the
        # gradient of the parameter it reaches last; ``grad_ready_seen`` tells whether it belongs to the
        # current step. Only timed steps stamp (the step timer sets ``armed``).
        self.grad_ready: Any = None
        self.grad_ready_seen = False
        self.armed = False
        # With DDP's own timers: a callable returning their averages (busy seconds, bytes, buckets).
        self.native: Any = None
        # Called by the step timer after each timed step while set (DDPTiming: until DDP has said which
        # parameter's gradient is ready last); clears itself.
        self.settle: Any = None

    def hold_native(self) -> None:
        """From now on, DDP's own timers read as they read now: exchanges after the run (a probe's steps) would
        join the sampled iterations they average."""
        if self.native is not None:
            held = self.native()
            self.native = lambda: held

    # ---------------------------------------------------------------------------- exchanges
    def launch(self, nbytes: int) -> None:
        """A collective of ``nbytes`` (as sent on the wire) starts now.

        Stamps come from the step's clock: on CUDA an event on the current stream, which the collective's
        stream waits for (so the stamp is when its input was ready on the device, not when the host queued
        it); on CPU ``perf_counter``."""
        self.launches.append(self.clock.stamp())
        self.bytes += nbytes

    def complete(self) -> None:
        """The oldest collective still in flight has finished. On CUDA an event on the current stream,
        which by now waits for the collective (a blocking call's ``wait``, or a future's callback, which
        runs with the current stream ordered after the collective): when it finished on the device."""
        self.completions.append(self.clock.stamp())

    def collective(self, nbytes: int) -> "CommRecorder":
        """``with recorder.collective(nbytes): <blocking exchange>``. Returns itself (no allocation):
        exchanges of one rank never nest."""
        self._bytes_pending = nbytes
        return self

    def __enter__(self) -> None:
        self.launch(self._bytes_pending)

    def __exit__(self, *exc: object) -> None:
        self.complete()

    # -------------------------------------------------------------------------- step edges
    def mark_grad_ready(self, *_: Any) -> None:
        """Autograd hook: backward has computed the last gradient (on a timed step: stamp it). Where two
        parameters are hooked, the later call overwrites the earlier one's stamp."""
        if not self.armed:
            return
        if self.clock.deferred:
            # Re-recording one event per step: the latest hook wins, as autograd runs them in order.
            if not self.grad_ready_seen:
                self.grad_ready = self.clock.stamp()
            else:
                self.grad_ready.record()
        else:
            self.grad_ready = time.perf_counter()
        self.grad_ready_seen = True

    def reset(self) -> None:
        self.launches.clear()
        self.completions.clear()
        self.bytes = 0
        self.grad_ready_seen = False

    def busy_seconds(self, lo: float = float("-inf"), hi: float = float("inf")) -> float:
        """Length of the union of [launch, completion] intervals, clipped to [lo, hi]: host stamps (CPU).
        CUDA events are resolved by the step timer once per window (:func:`union_seconds`)."""
        return union_seconds(self.launches, self.completions, lo, hi)


def union_seconds(launches: list[float], completions: list[float], lo: float = float("-inf"),
                  hi: float = float("inf")) -> float:
    """Length of the union of [launch, completion] intervals (buckets can be in flight together), clipped
    to [lo, hi]."""
    busy, end = 0.0, lo
    for start, stop in sorted(zip(launches, completions, strict=False)):
        stop = min(stop, hi)
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


class _NullRecorder(CommRecorder):
    """Profiling off: every report is dropped."""

    __slots__ = ()
    enabled = False

    def launch(self, nbytes: int) -> None:
        return None

    def complete(self) -> None:
        return None

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def mark_grad_ready(self, *_: Any) -> None:
        return None


NULL_RECORDER: CommRecorder = _NullRecorder()


def timed_allreduce_hook(recorder: CommRecorder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default behaviour (average by all-reduce) with the bucket's launch and completion stamped.

    Used where DDP's own timers cannot be (gradient aggregation: they only sample synchronizing steps).
    """
    buffer = bucket.buffer()
    recorder.launch(buffer.numel() * buffer.element_size())
    # Divide before summing, as torch's allreduce_hook does, so fp16 buffers cannot overflow.
    buffer.div_(dist.get_world_size())

    def stamp(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        recorder.complete()
        return fut.value()[0]

    return dist.all_reduce(buffer, async_op=True).get_future().then(stamp)


class DDPTiming:
    """Times plain DDP from the profiler's side; :class:`~dtrain.sync.ddp.DDPStrategy` calls
    :meth:`attach` for each DDP it builds that has no comm hook of its own (compression hooks report to
    the recorder themselves).

    ``native``: read DDP's C++ reducer timers (busy time, bucket sizes; sampled iterations, averaged)
    instead of a Python comm hook, which would complete a Python future on Gloo's thread for every bucket,
    which shows on small steps (docs/benchmarks.md, "Profiler overhead"). Private torch API (stable since
    1.9): on failure, fall back to the hook. Either way the last gradient is stamped, on timed steps, by an
    autograd hook on the parameter backward reaches last: the rest of ``backward()`` is waiting. At first
    that is a guess, the model's first parameter (a ``Linear``'s weight is accumulated after its bias; a
    tied input embedding after its last use). From DDP's second iteration on, DDP's logging data says in
    which order gradients became ready (``prev_iteration_grad_ready_order_indices``); where the last one is
    another parameter (a head defined before the body, say), it is hooked too, and being later, its stamp is
    the one kept. Few hooks: a hook costs a call into Python at every step, timed or not, even after its
    handle's ``remove()``, and on small steps those calls show (docs/benchmarks.md, "What the Trial's extra
    cost is made of").
    """

    def __init__(self, recorder: CommRecorder, native: bool) -> None:
        self.recorder = recorder
        self.native = native
        self._ddps: list[Any] = []
        self._hooked: set[int] = set()  # ids of the parameters holding a last-gradient hook
        self._unsettled: list[Any] = []  # DDPs whose gradients' order is not known yet
        self._tries = 0

    def attach_grad_ready(self, ddp: Any, model: nn.Module, guess: bool = True) -> None:
        """Only the last-gradient stamp, for a DDP whose comm hook reports its own buckets (compression):
        on CUDA the stamp is what splits backward from the wait for communication, since host times around
        the hook's asynchronous collectives say nothing of when they ran. ``guess=False``: no hook on the first
        parameter meanwhile, only the one DDP names (one hook per model: a script's run, whose first steps
        are warm-up)."""
        first = next((p for p in model.parameters() if p.requires_grad), None)
        if first is not None:
            if guess:
                self._hook(first)
            self._unsettled.append(ddp)
            self.recorder.settle = self._settle

    def attach(self, ddp: Any, model: nn.Module, guess: bool = True) -> None:
        self.attach_grad_ready(ddp, model, guess)
        if self.native:
            try:
                ddp._set_ddp_runtime_logging_sample_rate(NATIVE_SAMPLE_RATE)
            except (AttributeError, RuntimeError):
                self.native = False
        if not self.native:
            ddp.register_comm_hook(self.recorder, timed_allreduce_hook)
            return
        # A rebuilt DDP (fusion auto-tune) replaces the old one: only live ones are read.
        self._ddps = [*[d for d in self._ddps if d.module is not model], ddp]
        self.recorder.native = self.stats

    def _hook(self, param: nn.Parameter) -> None:
        if id(param) not in self._hooked:  # the guess itself, or a rebuilt DDP around the same module: once
            self._hooked.add(id(param))
            param.register_post_accumulate_grad_hook(self.recorder.mark_grad_ready)

    def _settle(self) -> None:
        """After a timed step: hook the parameter each DDP saw ready last, once DDP has said which (its
        order is logged from its second iteration); give up after :data:`SETTLE_TRIES` timed steps."""
        self._tries += 1
        waiting = []
        for ddp in self._unsettled:
            last = last_ready_parameter(ddp)
            if last is None:
                waiting.append(ddp)
            else:
                self._hook(last)
        self._unsettled = waiting if self._tries < SETTLE_TRIES else []
        if not self._unsettled:
            self.recorder.settle = None

    def stats(self) -> dict[str, float] | None:
        """DDP's averages over its sampled iterations, summed over the live DDPs; None before any."""
        totals = {"busy": 0.0, "bytes": 0.0, "buckets": 0.0}
        for ddp in self._ddps:
            data = ddp._get_ddp_logging_data()
            if not data.get("avg_backward_comm_time"):
                return None  # no sampled iteration yet
            totals["busy"] += data["avg_backward_comm_time"] / 1e9
            sizes = [int(x) for x in str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")).split(",")
                     if x.strip()]
            totals["bytes"] += float(sum(sizes))
            totals["buckets"] += float(len(sizes))
        return totals if self._ddps else None


# Timed steps to wait for DDP's gradient order before keeping the first-parameter guess.
SETTLE_TRIES = 50


def reducer_parameters(ddp: Any) -> list[nn.Parameter]:
    """The parameters in the order DDP's reducer indexes them (as DDP builds that list: each module's own
    parameters that require gradients and are not ignored, module by module, shared ones once)."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    seen: set[int] = set()
    params = []
    for module_name, module in ddp.module.named_modules():
        for name, param in module.named_parameters(recurse=False):
            # DDP's own key, also at the root (".weight"); it checks the same set.
            if param.requires_grad and f"{module_name}.{name}" not in ignored and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def last_ready_parameter(ddp: Any) -> nn.Parameter | None:
    """The parameter whose gradient DDP saw ready last in its previous iteration; None while DDP has not
    logged that order (before its second iteration) or where this torch does not log it."""
    try:
        order = ddp._get_ddp_logging_data().get("prev_iteration_grad_ready_order_indices")
    except (AttributeError, RuntimeError):
        return None
    indices = [int(i) for i in str(order or "").split(",") if i.strip()]
    params = reducer_parameters(ddp)
    if not indices or max(indices) >= len(params):
        return None
    return params[indices[-1]]
