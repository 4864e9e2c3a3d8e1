"""The model's own training steps, timed under each precision and at twice the batch: what the doctor's
precision and batch-size predictions rest on.

A matmul's speed-up in another precision bounds a step's, but a step is not only matmuls: attention,
softmax, norms, element-wise work, casts, the optimizer and memory traffic speed up less, or slow down
(bf16 autocast on a CPU casts every weight at every forward). So at the end of a profiled run, on the first
rank alone (the others wait), a few of the trial's own steps run on one of its batches: ``train_batch``
(forward and backward, gradients not exchanged) and every optimizer's ``step``, untimed first per setting
(new kernels, allocator) then :data:`STEPS_TIMED` times, more (up to :data:`MAX_STEPS_TIMED`) while the
rounds fit in :data:`TARGET_SECONDS`, fewer (at least once) where they would take over :data:`BUDGET_SECONDS`,
the settings interleaved round by round so that a disturbance hits them alike; the
median time counts: the prediction is of a run's mean step, and the least of a few steps is a best case whose
ratio between precisions drifts from that of typical steps wherever a disturbance grows with a step's length
(on a loaded CPU, the least-time ratio of float32 to bf16 was 2.5 where the median's was 2.0). Settings:
every precision the device has (:func:`precisions_for`) at the per-slot batch and at twice it, and on a CPU
the same at the other thread counts the caller names (``ModelSteps.shapes``). A precision's gain moves with
both (bf16 on a CPU without bf16 units gains little from threads and loses more per sample: docs/benchmarks.md),
so a gain timed at the run's shape is not carried to the shape a change of slots gives.

On a GPU, two things make a run's step differ from one step timed between two synchronizations, and the
probe does as the run does. The host queues kernels ahead of the device: a run's step costs the longer of
the host's work and the device's, so a timed sample is :data:`CHAIN` consecutive steps between two
synchronizations (on an H100, a bf16 step timed alone read 14.8 ms where the run's took 18.4 ms: the host
was the bound). And ``16-mixed`` steps through a ``GradScaler``, whose found-inf check waits for the device
once a step: that wait is in its steps here too. The first round of a new precision pays for its kernels'
first launches (seconds on a GPU): a second untimed round, one step per setting, sizes the timed ones there,
and chains only where :data:`STEPS_TIMED` rounds of them fit in :data:`BUDGET_SECONDS` (a long step is
the device's, and chaining it would only multiply the probe's cost). Each sample also keeps the host's own
seconds to queue its steps: where they come near the sample's, the host is the bound in that precision, and
whatever else the run's host does each step (fetching a batch) adds to its step there.

On a CPU each timed step comes right after an untimed one of the same setting, as a run's step comes after
the one before it: right after another setting (a bf16 step at twice the batch) a float32 step runs with its
weights and activations out of the caches, which the interleaving would otherwise put into every setting that
follows another (docs/benchmarks.md, "A precision at another slot count"). A setting whose steps take over
:data:`LEAD_STEP_MAX_SECONDS` goes without: the refill is lost in a step that long.

Training is left as it was: the models' and optimizers' state and the random generators are saved before
and restored after (:func:`restored`), and gradients are cleared.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import random
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from dtrain.profiling.record import ModelSteps
from dtrain.profiling.runfacts import ProbeHooks, SwitchablePrecision
from dtrain.profiling.sections import ShapeTime

# Timed steps per setting, after one warm-up step each: at least STEPS_TIMED (a median that one disturbed step
# does not move), and more, up to MAX_STEPS_TIMED, while the timed rounds (every thread count's together) fit in
# TARGET_SECONDS: the median of a few short steps moves a precision's gain from one run to the next
# (docs/benchmarks.md).
STEPS_TIMED, MAX_STEPS_TIMED = 5, 25
TARGET_SECONDS = 0.5
# Seconds the timed rounds may take together at most, judged by the warm-up round (a step of every setting).
BUDGET_SECONDS = 10.0
# On a CPU, a setting whose step takes longer than this is timed without an untimed step of its own before
# it: what a step after another setting pays is a refill of the caches, a fraction of a millisecond, which a
# step this long does not feel, and a lead step would double the cost of the probe's slowest settings (bf16
# on a CPU without bf16 units: docs/benchmarks.md, "What the end-of-run probes add to a run").
LEAD_STEP_MAX_SECONDS = 0.05
# Consecutive steps in one timed sample on a GPU, between two synchronizations: the host runs ahead of the
# device as in a run (a CPU's steps do not overlap: one).
CHAIN = 4
# Expected range of n normal draws in standard deviations (d2 of quality control charts), for n timed steps.
RANGE_IN_SIGMAS = {2: 1.128, 3: 1.693, 4: 2.059, 5: 2.326, 6: 2.534, 7: 2.704, 8: 2.847, 9: 2.970, 10: 3.078,
                   11: 3.173, 12: 3.258, 13: 3.336, 14: 3.407, 15: 3.472, 16: 3.532, 17: 3.588, 18: 3.640,
                   19: 3.689, 20: 3.735, 21: 3.778, 22: 3.819, 23: 3.858, 24: 3.895, 25: 3.931}
# The autocast dtype of each precision (None: float32, no autocast).
AUTOCAST: dict[str, torch.dtype | None] = {"32-true": None, "tf32": None, "bf16-mixed": torch.bfloat16,
                                           "16-mixed": torch.float16}

log = logging.getLogger(__name__)


def precisions_for(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The precisions this device runs (in the order they are timed) and, for the others, why not."""
    if device.type != "cuda":
        return ["32-true", "bf16-mixed"], {
            "tf32": "TF32 is a CUDA tensor-core mode: on a CPU it is 32-true",
            "16-mixed": "16-mixed needs a CUDA GPU (float16 autocast with loss scaling)"}
    timed, skipped = ["32-true", "tf32"], {}
    if torch.cuda.is_bf16_supported():
        timed.append("bf16-mixed")
    else:
        skipped["bf16-mixed"] = f"{torch.cuda.get_device_name(device)} has no bfloat16"
    timed.append("16-mixed")
    return timed, skipped


@contextlib.contextmanager
def as_precision(name: str, precision: SwitchablePrecision, device: torch.device) -> Iterator[None]:
    """Run the trial's step in precision ``name``. Where the run's models have mixed precision, their wrapped
    forwards read the precision's autocast dtype at each call: it is set for the moment. Otherwise (a
    32-true or tf32 run) an autocast around the step gives the mixed precisions. TF32 is switched for tf32."""
    dtype, wrapped, original = AUTOCAST[name], precision.dtype is not None, precision.dtype
    cuda = device.type == "cuda"
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) if cuda else None
    try:
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = name == "tf32"
        if wrapped:
            precision.dtype = dtype
        outer = (torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None and not wrapped
                 else contextlib.nullcontext())
        with outer:
            yield
    finally:
        precision.dtype = original
        if tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


@contextlib.contextmanager
def restored(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
             device: torch.device) -> Iterator[None]:
    """Put the models' parameters and buffers, the optimizers' state and every random generator back as
    they were, whatever ran inside; gradients are cleared. The copies are kept in host memory: a model that
    fills its GPU has no room for a second copy there (the end-of-run probes save them only within a host memory
    budget: :func:`dtrain.profiling.probeguard.state_refusal`)."""
    weights = [_host_copy(m.state_dict()) for m in models]
    states = [_host_copy(opt.state_dict()) for opt in optimizers]
    cpu_rng, py_rng, np_rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        with torch.no_grad():
            for model, saved in zip(models, weights, strict=True):
                model.load_state_dict(saved)
        for opt, state in zip(optimizers, states, strict=True):
            opt.load_state_dict(state)
            opt.zero_grad(set_to_none=True)
        torch.set_rng_state(cpu_rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


def _to_host(value: object) -> object:
    """``value`` (tensors in dicts and lists) copied, its tensors into host memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_host(v) for v in value]
    return copy.deepcopy(value)


def _host_copy(state: Mapping[str, object]) -> dict[str, object]:
    """A state dict copied into host memory."""
    return {k: _to_host(v) for k, v in state.items()}


def _step(hooks: ProbeHooks, optimizers: Sequence[torch.optim.Optimizer], batch: object,
          scaler: torch.amp.GradScaler | None) -> None:
    hooks.train_batch(batch, 0, 0)  # forward and backward (gradient_sync(False): no exchange, no update)
    scaled = False
    for opt in optimizers:
        if scaler is not None and _has_gradients(opt):
            scaler.step(opt)  # as a 16-mixed run steps: unscale, wait for the found-inf flag, step
            scaled = True
        else:  # (a scaler refuses an optimizer that got no gradients: its step does nothing either way)
            opt.step()
        opt.zero_grad(set_to_none=True)
    if scaled:
        scaler.update()  # type: ignore[union-attr]


def _has_gradients(opt: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for group in opt.param_groups for p in group["params"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loss_scaler(device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler ready to step: the trial's backward scales with the run's own scaler (a 16-mixed run's)
    or none, so this one's scale is made here, as its first ``scale()`` would."""
    scaler = torch.amp.GradScaler(device.type)
    scaler.scale(torch.ones((), device=device))
    return scaler


def _chain(device: torch.device) -> int:
    """Steps in one timed sample: :data:`CHAIN` on a GPU, whose host queues work ahead; one on a CPU."""
    return CHAIN if device.type == "cuda" else 1


def _too_big(exc: Exception) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


# One setting: (precision, batch, torch threads; None: as the run has them).
Setting = tuple[str, object, int | None]


@contextlib.contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    """Within: ``threads`` torch threads (None: as they are)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads is not None:
            torch.set_num_threads(before)


def _round(hooks: ProbeHooks, optimizers: Sequence[torch.optim.Optimizer], device: torch.device,
           settings: dict[str, Setting], failed: dict[str, str], times: dict[str, list[float]],
           timed: bool, scalers: dict[str, torch.amp.GradScaler], chain: int = 1,
           queued: dict[str, list[float]] | None = None, last: dict[str, float] | None = None) -> float:
    """One sample of every setting not failed yet (``chain`` steps in a row); its seconds per step join
    ``times`` where ``timed``, and the host's seconds per step to queue them (until the last step's calls
    returned, before the device caught up) join ``queued`` where given; ``last`` keeps each setting's latest
    seconds per step, timed or not. A setting that fails is entered in ``failed`` with its reason. Returns the
    round's seconds."""
    began_round = time.perf_counter()
    last = {} if last is None else last
    for key, (name, data, _) in settings.items():
        if key in failed:
            continue
        try:
            with as_precision(name, hooks.precision, device):
                # A step as a run takes it: right after one like it (see above), where that matters.
                if device.type != "cuda" and last.get(key, 0.0) <= LEAD_STEP_MAX_SECONDS:
                    _step(hooks, optimizers, data, scalers.get(key))
                _sync(device)
                began = time.perf_counter()
                for _ in range(chain):
                    _step(hooks, optimizers, data, scalers.get(key))
                host = time.perf_counter()
                _sync(device)
        except Exception as exc:  # a setting the model or the memory cannot take: said, not fatal
            failed[key] = ("out of memory" if _too_big(exc) else f"failed: {exc}".splitlines()[0])[:200]
            log.info("model-step probe: %s %s", key, failed[key])
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        last[key] = (time.perf_counter() - began) / chain
        if timed:
            times[key].append(last[key])
            if queued is not None:
                queued[key].append((host - began) / chain)
    return time.perf_counter() - began_round


def _time_block(hooks: ProbeHooks, optimizers: Sequence[torch.optim.Optimizer], device: torch.device,
                settings: dict[str, Setting], failed: dict[str, str], times: dict[str, list[float]],
                scalers: dict[str, torch.amp.GradScaler], steps: int, share: float,
                host_times: dict[str, list[float]], budget_seconds: float | None = None) -> int:
    """Warm-up, then timed rounds of ``settings`` (interleaved), this block's ``share`` of the probe's target and
    budget (``budget_seconds``, else :data:`BUDGET_SECONDS`): how many rounds were timed."""
    target = TARGET_SECONDS * share
    budget = (BUDGET_SECONDS if budget_seconds is None else budget_seconds) * share
    chain, queued, last = 1, _chain(device), {}
    warm_up = _round(hooks, optimizers, device, settings, failed, times, False, scalers, last=last)
    if queued > 1:  # the first round paid for new kernels: the next one sizes the timed rounds
        warm_up = _round(hooks, optimizers, device, settings, failed, times, False, scalers, last=last)
        if warm_up * queued * STEPS_TIMED <= budget:
            chain = queued
            warm_up *= chain
    # Short steps get more timed rounds, long ones fewer (at least one): the probe stays a small cost.
    if warm_up > 0:
        steps = max(1, min(max(steps, min(MAX_STEPS_TIMED, int(target / warm_up))), int(budget / warm_up)))
    for _ in range(steps):
        _round(hooks, optimizers, device, settings, failed, times, True, scalers, chain, host_times, last)
    return steps


def time_model_steps(hooks: ProbeHooks, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                     device: torch.device, batch: object, double: object, per_slot: int,
                     steps: int = STEPS_TIMED, keep_state: bool = True,
                     other_threads: Sequence[int] = (), budget: float | None = None,
                     double_skipped: str | None = None) -> ModelSteps:
    """The model's steps timed as the module's docstring says; run on one rank with gradient exchange
    off. ``other_threads``: thread counts besides the present one to time every setting at too (a CPU's).
    Never raises for a setting that fails: it is skipped with its reason. ``keep_state`` False: the
    caller restores the models, optimizers and random generators itself (:func:`restored`). ``budget``: seconds
    the timed rounds may take (else :data:`BUDGET_SECONDS`; the end-of-run probes' budget left bounds it);
    ``double_skipped``: why twice the batch is not tried (``double`` is then not run: a GPU without room for it)."""
    start = time.perf_counter()
    run = hooks.precision.name
    names, skipped = precisions_for(device)
    if run not in names:  # tf32 on a CPU runs as float32: timed under the run's own name all the same
        names.insert(0, run)
        skipped.pop(run, None)
    present = torch.get_num_threads()
    settings: dict[str, Setting] = {name: (name, batch, None) for name in names}
    settings["double"] = (run, double, None)
    shapes = _shape_settings(names, run, batch, double, present,
                             [t for t in other_threads if t != present] if device.type == "cpu" else [])
    settings.update(shapes)
    times: dict[str, list[float]] = {key: [] for key in settings}
    host_times: dict[str, list[float]] = {key: [] for key in settings}
    # Twice the batch not tried: every setting of it is skipped, with the caller's reason.
    failed: dict[str, str] = ({key: double_skipped for key, (_, data, _) in settings.items() if data is double}
                              if double_skipped is not None else {})
    # 16-mixed steps through a loss scaler of its own here, one per setting (a 16-mixed run's scaler is left
    # as it was; its twice-the-batch setting gets one too).
    scalers = {key: loss_scaler(device) for key, (name, _, _) in settings.items() if name == "16-mixed"}
    # One block per thread count, the run's own first: the thread count switches once per block, and the block's
    # warm-up round takes what a switch costs the next steps (an OpenMP pool resized), not its timed rounds.
    blocks = sorted({threads for (_, _, threads) in settings.values()}, key=lambda t: t is not None)
    rounds = steps
    with restored(models, optimizers, device) if keep_state else contextlib.nullcontext():
        for threads in blocks:
            block = {key: setting for key, setting in settings.items() if setting[2] == threads}
            with _threads(threads):
                timed = _time_block(hooks, optimizers, device, block, failed, times, scalers, steps,
                                    1 / len(blocks), host_times, budget)
            rounds = timed if threads is None else rounds
    skipped.update({k: v for k, v in failed.items() if k != "double" and k not in shapes})
    best = {key: statistics.median(seconds) if seconds else float("inf") for key, seconds in times.items()}
    spreads = {k: relative_spread(v) for k, v in times.items() if k not in failed and len(v) > 1}
    return ModelSteps(per_slot_batch_size=per_slot, run_precision=run, steps_timed=rounds,
                      threads=present,
                      shapes=[ShapeTime(precision=name, batch_factor=1 if data is batch else 2,
                                        threads=threads or present, seconds=best[key], relative_spread=spreads.get(key))
                              for key, (name, data, threads) in shapes.items() if key not in failed],
                      seconds_per_step={k: best[k] for k in names if k not in failed},
                      skipped=skipped,
                      double_batch_seconds_per_step=None if "double" in failed else best["double"],
                      double_batch_skipped=failed.get("double"),
                      cost_seconds=time.perf_counter() - start,
                      relative_spread={k: v for k, v in spreads.items() if k not in shapes},
                      host_seconds_per_step={k: statistics.median(v) for k, v in host_times.items()
                                             if k not in failed and k not in shapes and v})


def _shape_settings(names: list[str], run: str, batch: object, double: object, present: int,
                    other_threads: Sequence[int]) -> dict[str, Setting]:
    """The settings beyond the run's shape (:attr:`ModelSteps.shapes`): every other precision at twice the
    batch, and every precision at both batches on each of ``other_threads``."""
    out: dict[str, Setting] = {f"{name} x2": (name, double, None) for name in names if name != run}
    for threads in other_threads:
        for name in names:
            out[f"{name} on {threads}"] = (name, batch, threads)
            out[f"{name} x2 on {threads}"] = (name, double, threads)
    return out


def relative_spread(seconds: list[float]) -> float:
    """One relative standard deviation of a setting's timed steps: their range over the least, divided by the
    expected range of that many normal draws in standard deviations (d2). Needs two or more steps."""
    least = min(seconds)
    return (max(seconds) - least) / least / RANGE_IN_SIGMAS.get(len(seconds), 3.0) if least > 0 else 0.0
