"""Where an unmodified script's steps are: hooks on what torch already calls, never on the script's modules.

A script's step is found from five places, each a global hook or one wrapped function, installed before the
script runs (:func:`install`):

* ``torch.autograd.backward`` (what ``loss.backward()`` calls): a backward begins and ends; the time since the
  previous edge was ``forward`` (the loss included, as for a Trial);
* the optimizers' global step hooks (``register_optimizer_step_pre_hook``/``_post_hook``), and
  ``GradScaler.step``: a step ends at an outermost ``step()`` that follows a backward. A step the scaler skips
  (no ``optimizer.step()`` inside) still ends there. Lightning runs forward and backward inside
  ``step(closure)``: the edges nest, and the optimizer's own time is what follows the backward;
* the DataLoader iterator's ``__next__``: the data wait. A batch drawn with gradients off is evaluation: the
  step under way is dropped and timing starts again at the next training batch (validation is not a step);
* ``DistributedDataParallel.__init__``: each DDP model, timed by DDP's own sampled timers
  (:class:`dtrain.profiling.comm.DDPTiming`: busy seconds, bucket bytes; the last-gradient stamp that splits
  backward from the exposed wait, one autograd hook per model, on the parameter DDP names ready last);
* ``torch.distributed.destroy_process_group`` is the session's (:mod:`dtrain.engine.scriptprof`);
* ``DataLoader.__init__`` and ``Optimizer.__init__``: where the script built them (its file and line, from the
  stack, once each: the line a change only an edit makes is named by), and a change from outside applied
  (:mod:`dtrain.profiling.script.overrides`: the loader's workers, pinning, persistence; DDP's buckets, static
  graph and comm hook, the hook registered at the first backward where the script registered none);
* on CUDA, ``torch.cuda.set_sync_debug_mode("warn")``: each synchronizing call (``.item()``, a copy to the CPU)
  warns, and a warnings hook counts those warnings (and shows none of them) while the steps run.

DDP samples iterations by count (its reducer's ``num_iterations_``, the first ten then every tenth), and counts
only forwards that will exchange (``prepare_for_forward`` runs where ``require_backward_grad_sync`` holds): under
``no_sync`` accumulation its samples fall on exchanging iterations only, and its busy time and bytes are per
exchange; they are scaled here by the exchanges per optimizer step (every micro-batch without ``no_sync``).

Hot path: each edge is the step timer's own (two appends and a clock read); no host synchronization, no
allocation beyond a few floats. Every hook body catches its own errors: the first one disables profiling with
one log line, and the script trains on as it would have.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import dataloader as _dl

from dtrain.profiling.comm import DDPTiming
from dtrain.profiling.script import outside
from dtrain.profiling.script.overrides import Overrides
from dtrain.profiling.timer import FLUSH_EVERY, StepTimer

log = logging.getLogger("dtrain")


class LoaderFacts:
    """The training loader as its iterators show it (read once per iterator: an epoch)."""

    __slots__ = ("batch_size", "first_batch_seconds", "iterators", "num_workers", "persistent_workers", "pin_memory",
                 "prefetch_factor", "site")

    def __init__(self) -> None:
        self.batch_size: int | None = None
        self.num_workers = 0
        self.pin_memory = False
        self.persistent_workers = False
        self.prefetch_factor: int | None = None
        self.iterators = 0
        # From the step before to the first batch of each epoch after the first (its iterator's start included).
        self.first_batch_seconds: list[float] = []
        self.site: str | None = None  # where the script built it (file:line)

    def saw(self, it: Any) -> None:
        sampler = getattr(it, "_index_sampler", None)
        size = getattr(sampler, "batch_size", None)
        self.batch_size = int(size) if isinstance(size, int) else self.batch_size
        self.num_workers = int(getattr(it, "_num_workers", 0) or 0)
        self.pin_memory = bool(getattr(it, "_pin_memory", False))
        self.persistent_workers = bool(getattr(it, "_persistent_workers", False))
        factor = getattr(it, "_prefetch_factor", None)
        self.prefetch_factor = int(factor) if isinstance(factor, int) and self.num_workers else None
        self.iterators += 1
        self.site = _LOADER_SITES.get(id(getattr(it, "_dataset", None)), self.site)


class StepsDone(SystemExit):
    """Raised from the optimizer's step hook once ``stop_after`` steps are done: the script unwinds and exits
    with code 0 on every rank after the same step (``--verify``'s rounds of a script). A ``SystemExit``, so
    that the hooks' own error guard lets it through."""


class ScriptProfiler:
    """One process's view of a script's steps (see the module's doc). ``start_wall``: when the process began."""

    def __init__(self, warmup_steps: int = 3, stop_after: int | None = None,
                 overrides: Overrides | None = None) -> None:
        self.on = True
        # Changes from outside (--try/--verify of a script): applied where the script builds loaders and models.
        self.overrides = overrides
        self.sites: dict[str, str] = {}  # "loader", "optimizer", "ddp", "backward" -> the script's file:line
        self._pending_hooks: list[Any] = []  # DDP models the overrides' comm hook goes on at their first backward
        self.host_syncs = 0  # synchronizing CUDA calls counted while the steps ran (CUDA only)
        self.counting_syncs = False
        self._first_fetch = False
        self.refused: list[str] = []  # overrides that could not be applied, one line each
        self.warmup_steps = warmup_steps
        # Stop the script after this many optimizer steps (every rank after the same one: steps are synchronous).
        self.stop_after = stop_after
        # Called once on every rank at that step, before the script unwinds (the session takes its figures there,
        # the all-reduce latency probed as at the script's destroy_process_group()).
        self.on_stop: Callable[[], None] | None = None
        self.timer: StepTimer | None = None
        self.device: torch.device | None = None
        self.ddp_timing: DDPTiming | None = None
        self.ddps: list[Any] = []  # weak references to each DDP model built
        self.ddp_caps: list[float | None] = []  # bucket_cap_mb as each was given (None: DDP's default)
        self.optimizers: list[Any] = []  # weak references, in order of their first step
        self.optimizer_names: list[str] = []
        self.lr: float | None = None  # the first optimizer's first group's, at its first step
        self.parameters = 0  # the first optimizer's, at its first step (DDP's models, where built, say more)
        self.loader = LoaderFacts()
        self._train_iter: Any = None  # the iterator the last training batch came from (a weak reference)
        self.evaluating = False
        self._fetching = False
        self._eval_began = 0.0
        self.validation_seconds = 0.0
        self._opt_depth = 0
        self._bwd_depth = 0
        self.backwards_in_step = 0
        self.exchanges_in_step = 0
        self.no_sync = False
        self.grad_scaler = False
        # Over every step: backwards and exchanges (means per step from these), the first and last step's ends.
        self.backwards = 0
        self.exchanges = 0
        self.first_step_at: float | None = None
        self.last_step_at: float | None = None
        self.phase_windows: list[tuple[int, dict[str, float]]] = []  # (step, mean phase seconds) for TensorBoard

    # ------------------------------------------------------------------------------------ state
    def disable(self, where: str, exc: BaseException) -> None:
        """A hook failed: stop profiling (the script goes on untouched) and say so once."""
        if self.on:
            self.on = False
            log.warning("dtrain: profiling stopped (%s raised %s: %s); the script goes on unprofiled",
                        where, type(exc).__name__, exc)

    def _ensure_timer(self, device: torch.device) -> StepTimer:
        if self.timer is None:
            self.device = device
            self.timer = StepTimer(device, warmup_steps=self.warmup_steps)
            self.timer.start_step()
            if device.type == "cuda":
                self.counting_syncs = True
                outside.count_host_syncs(self, cuda=True)
        return self.timer

    def saw_sync(self) -> None:
        """A synchronizing CUDA call: counted within the steps (not before the first, nor in evaluation)."""
        if self.on and self.timer is not None and not self.evaluating:
            self.host_syncs += 1

    # ------------------------------------------------------------------------------------ edges
    def add_ddp(self, ddp: Any, cap_mb: float | None) -> None:
        """A DDP model was built: time it by DDP's own sampled timers."""
        param = next((p for p in ddp.module.parameters()), None)
        timer = self._ensure_timer(param.device if param is not None else torch.device("cpu"))
        if self.ddp_timing is None:
            self.ddp_timing = DDPTiming(timer.recorder, native=True)
        # One autograd hook per model, on the parameter DDP names ready last (from its second iteration).
        self.ddp_timing.attach(ddp, ddp.module, guess=False)
        self.ddps.append(weakref.ref(ddp))
        self.ddp_caps.append(cap_mb)
        hook = self.overrides.comm_hook if self.overrides is not None else None
        if hook not in (None, "none"):
            self._pending_hooks.append(weakref.ref(ddp))

    def before_next(self, it: Any) -> None:
        timer = self.timer
        if not torch.is_grad_enabled():  # evaluation: not a step
            if not self.evaluating:
                self.evaluating, self._eval_began = True, time.perf_counter()
            return
        if self._train_iter is None or self._train_iter() is not it:
            self._train_iter = weakref.ref(it)
            self.loader.saw(it)
            self._first_fetch = self.last_step_at is not None and len(self.loader.first_batch_seconds) < MAX_EPOCHS
        if timer is None:
            return
        if self.evaluating:  # back to training: time from here, the evaluation left out
            self.evaluating = False
            self.validation_seconds += time.perf_counter() - self._eval_began
            timer.start_step()
            self.backwards_in_step = self.exchanges_in_step = 0
        else:
            timer.lap("other")
        self._fetching = True

    def after_next(self) -> None:
        if self._fetching:
            self._fetching = False
            self.timer.lap("data")  # type: ignore[union-attr]
            if self._first_fetch and self.last_step_at is not None:
                self._first_fetch = False
                self.loader.first_batch_seconds.append(time.perf_counter() - self.last_step_at)

    def backward_begin(self, tensors: Any) -> None:
        self._bwd_depth += 1
        if self._bwd_depth > 1:  # a backward inside a backward (a hook's own): one phase
            return
        timer = self.timer
        if timer is None:
            device = tensors.device if isinstance(tensors, torch.Tensor) else torch.device("cpu")
            timer = self._ensure_timer(device)
        self.backwards_in_step += 1
        if "backward" not in self.sites:
            self.sites["backward"] = outside.script_site()
        if self._pending_hooks:
            self._add_comm_hooks()
        exchanging = False
        for ref in self.ddps:
            ddp = ref()
            if ddp is not None and ddp.require_backward_grad_sync:
                exchanging = True
            elif ddp is not None:
                self.no_sync = True
        if exchanging:
            self.exchanges_in_step += 1
        timer.backward_begin()

    def backward_end(self) -> None:
        self._bwd_depth = max(0, self._bwd_depth - 1)  # an end without its begin (hooks put in mid-step)
        if self._bwd_depth == 0 and self.timer is not None:
            self.timer.backward_end()

    def step_begin(self) -> None:
        self._opt_depth += 1
        if self._opt_depth == 1 and self.timer is not None:
            self.timer.lap("other")

    def step_end(self, optimizer: Any) -> None:
        self._opt_depth = max(0, self._opt_depth - 1)
        timer = self.timer
        if self._opt_depth or timer is None:
            return
        timer.lap("optimizer")
        if not self.backwards_in_step:  # a step without a backward (a second optimizer): not a step of its own
            return
        if optimizer is not None and not any(ref() is optimizer for ref in self.optimizers):
            self._new_optimizer(optimizer)
        timer.exchanging = self.exchanges_in_step > 0
        timer.end_step()
        now = time.perf_counter()
        if self.first_step_at is None:
            self.first_step_at = now
        self.last_step_at = now
        self.backwards += self.backwards_in_step
        self.exchanges += self.exchanges_in_step
        self.backwards_in_step = self.exchanges_in_step = 0
        if timer.steps % WINDOW == 0 and len(self.phase_windows) < MAX_WINDOWS:
            window = timer.take_window()
            if window:
                self.phase_windows.append((timer.steps, window))
        timer.start_step()
        if self.stop_after is not None and timer.steps >= self.stop_after:
            if self.on_stop is not None:  # every rank is here, its group alive: the figures are taken now
                self.on_stop()
            raise StepsDone(0)

    def _add_comm_hooks(self) -> None:
        """The overrides' comm hook on each DDP model whose script registered none (a script's own hook is
        named in the record, never replaced); before its first backward, where its reducer first needs one."""
        pending, self._pending_hooks = self._pending_hooks, []
        name = self.overrides.comm_hook if self.overrides is not None else None
        for ref in pending:
            ddp = ref()
            if ddp is None or name is None:
                continue
            try:
                registered = ddp._get_ddp_logging_data().get("comm_hook")
            except (AttributeError, RuntimeError):
                registered = None
            if registered or getattr(ddp, "_comm_hooks", None):
                log.warning("dtrain: the script registered its own DDP comm hook (%s): ddp.comm_hook=%s not applied",
                            registered, name)
                continue
            try:
                ddp.register_comm_hook(*outside.comm_hook(name))
            except (TypeError, RuntimeError, ValueError) as exc:  # bf16 without CUDA and NCCL, say
                self.refused.append(f"ddp.comm_hook={name} could not be registered ({exc})")
                log.warning("dtrain: %s", self.refused[-1])

    # ------------------------------------------------------------------------------------ facts
    def _new_optimizer(self, optimizer: Any) -> None:
        """Its name and learning rate now: a script's optimizer may be gone by the end (its main() returned)."""
        self.optimizers.append(weakref.ref(optimizer))
        self.optimizer_names.append(type(optimizer).__name__)
        lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        if self.lr is None and isinstance(lr, (int, float)) and not isinstance(lr, bool):
            self.lr = float(lr)
        if not self.parameters:
            self.parameters = sum(p.numel() for g in optimizer.param_groups for p in g["params"])

    def live_ddps(self) -> list[tuple[Any, float | None]]:
        return [(ref(), cap) for ref, cap in zip(self.ddps, self.ddp_caps, strict=True) if ref() is not None]

    def live_optimizers(self) -> list[Any]:
        return [opt for opt in (ref() for ref in self.optimizers) if opt is not None]


# Steps per TensorBoard window of phase means (the timer's own flush period: on CUDA no extra synchronization),
# and the windows kept.
WINDOW = FLUSH_EVERY
MAX_WINDOWS = 2000
# Epochs whose first batch's wait is kept; DataLoaders whose construction site is remembered.
MAX_EPOCHS = 100
MAX_LOADER_SITES = 64
_LOADER_SITES: dict[int, str] = {}  # id(dataset) -> where the script built the DataLoader over it
_ACTIVE: ScriptProfiler | None = None
_ORIGINALS: dict[str, Any] = {}


def active() -> ScriptProfiler | None:
    """The process's profiler while installed."""
    return _ACTIVE


def _guarded(where: str, body: Callable[..., None], *args: Any) -> None:
    prof = _ACTIVE
    if prof is None or not prof.on:
        return
    try:
        body(*args)
    except Exception as exc:  # a profiler's fault must never become the script's
        prof.disable(where, exc)


def _patched_next(self: Any) -> Any:
    prof = _ACTIVE
    if prof is None or not prof.on:
        return _ORIGINALS["next"](self)
    _guarded("DataLoader.__next__", prof.before_next, self)
    try:
        return _ORIGINALS["next"](self)
    finally:
        if prof._fetching:
            _guarded("DataLoader.__next__", prof.after_next)


def _patched_backward(*args: Any, **kwargs: Any) -> Any:
    prof = _ACTIVE
    if prof is None or not prof.on:
        return _ORIGINALS["backward"](*args, **kwargs)
    _guarded("backward", prof.backward_begin, args[0] if args else kwargs.get("tensors"))
    try:
        return _ORIGINALS["backward"](*args, **kwargs)
    finally:
        _guarded("backward", prof.backward_end)


def _pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    _guarded("optimizer.step", _ACTIVE.step_begin if _ACTIVE is not None else _noop)


def _post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    _guarded("optimizer.step", _ACTIVE.step_end if _ACTIVE is not None else _noop, optimizer)


def _noop(*_: Any) -> None:
    return None


def _patched_scaler_step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    prof = _ACTIVE
    if prof is None or not prof.on:
        return _ORIGINALS["scaler_step"](self, optimizer, *args, **kwargs)
    prof.grad_scaler = True
    _guarded("GradScaler.step", prof.step_begin)
    try:
        return _ORIGINALS["scaler_step"](self, optimizer, *args, **kwargs)
    finally:
        _guarded("GradScaler.step", prof.step_end, optimizer)


def _ddp_cap(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
    """``bucket_cap_mb`` as the script passed it, by name or position (None: DDP's default)."""
    try:
        bound = inspect.signature(_ORIGINALS["ddp_init"]).bind(None, *args, **kwargs)
    except TypeError:
        return None
    cap = bound.arguments.get("bucket_cap_mb")
    return float(cap) if isinstance(cap, (int, float)) else None


def _patched_ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
    prof = _ACTIVE
    over = prof.overrides if prof is not None and prof.on else None
    changes = outside.ddp_changes(over) if over is not None else {}
    if changes:  # a change from outside: what DDP is built with (the record says what ran)
        with contextlib.suppress(TypeError):  # arguments DDP itself refuses: its own error, unchanged
            args, kwargs = outside.with_overrides(_ORIGINALS["ddp_init"], args, kwargs, changes)
    _ORIGINALS["ddp_init"](self, *args, **kwargs)
    if prof is not None and prof.on:
        prof.sites.setdefault("ddp", outside.script_site())
        _guarded("DistributedDataParallel", lambda: prof.add_ddp(self, _ddp_cap(args, kwargs)))


def _patched_loader_init(self: Any, *args: Any, **kwargs: Any) -> None:
    prof = _ACTIVE
    over = prof.overrides if prof is not None and prof.on else None
    if over is not None:
        with contextlib.suppress(TypeError):  # arguments DataLoader itself refuses: its own error, unchanged
            changes = outside.loader_changes(_ORIGINALS["loader_init"], over, args, kwargs)
            if changes:
                args, kwargs = outside.with_overrides(_ORIGINALS["loader_init"], args, kwargs, changes)
    _ORIGINALS["loader_init"](self, *args, **kwargs)
    if prof is not None and prof.on and len(_LOADER_SITES) < MAX_LOADER_SITES:
        _LOADER_SITES.setdefault(id(self.dataset), outside.script_site())


def _patched_optimizer_init(self: Any, *args: Any, **kwargs: Any) -> None:
    _ORIGINALS["optimizer_init"](self, *args, **kwargs)
    prof = _ACTIVE
    if prof is not None and prof.on and "optimizer" not in prof.sites:
        prof.sites["optimizer"] = outside.script_site()


def install(profiler: ScriptProfiler) -> None:
    """Put the hooks in (once per process) and make ``profiler`` the one they feed."""
    global _ACTIVE
    from torch.amp import GradScaler
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _ACTIVE = profiler
    tf32 = profiler.overrides.tf32 if profiler.overrides is not None else None
    if tf32 is not None:  # a change from outside, before the script runs (the script may still set its own)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    if "next" in _ORIGINALS:
        return
    _ORIGINALS.update(next=_dl._BaseDataLoaderIter.__next__, backward=torch.autograd.backward,
                      scaler_step=GradScaler.step, ddp_init=DistributedDataParallel.__init__,
                      loader_init=_dl.DataLoader.__init__, optimizer_init=torch.optim.Optimizer.__init__)
    _dl._BaseDataLoaderIter.__next__ = _patched_next  # type: ignore[method-assign]
    torch.autograd.backward = _patched_backward  # type: ignore[assignment]
    GradScaler.step = _patched_scaler_step  # type: ignore[method-assign]
    DistributedDataParallel.__init__ = _patched_ddp_init  # type: ignore[method-assign]
    _dl.DataLoader.__init__ = _patched_loader_init  # type: ignore[method-assign]
    torch.optim.Optimizer.__init__ = _patched_optimizer_init  # type: ignore[method-assign]
    _ORIGINALS["handles"] = (register_optimizer_step_pre_hook(_pre_hook), register_optimizer_step_post_hook(_post_hook))


def uninstall() -> None:
    """Take the hooks out (tests; the end of a run leaves them, inert, where the script may still call them)."""
    global _ACTIVE
    _ACTIVE = None
    outside.stop_counting_syncs()
    if not _ORIGINALS:
        return
    from torch.amp import GradScaler
    from torch.nn.parallel import DistributedDataParallel

    _dl._BaseDataLoaderIter.__next__ = _ORIGINALS["next"]  # type: ignore[method-assign]
    torch.autograd.backward = _ORIGINALS["backward"]
    GradScaler.step = _ORIGINALS["scaler_step"]  # type: ignore[method-assign]
    DistributedDataParallel.__init__ = _ORIGINALS["ddp_init"]  # type: ignore[method-assign]
    _dl.DataLoader.__init__ = _ORIGINALS["loader_init"]  # type: ignore[method-assign]
    torch.optim.Optimizer.__init__ = _ORIGINALS["optimizer_init"]  # type: ignore[method-assign]
    for handle in _ORIGINALS["handles"]:
        with contextlib.suppress(Exception):
            handle.remove()
    _ORIGINALS.clear()


def stop() -> None:
    """The run's figures are taken: the hooks stay in (the script may still hold them) but feed nothing."""
    global _ACTIVE
    _ACTIVE = None
    outside.stop_counting_syncs()
