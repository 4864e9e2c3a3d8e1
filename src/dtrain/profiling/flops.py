"""Model FLOPs utilization (MFU): the model's FLOPs per step over what the device's matmuls reach.

The FLOPs of one training step (forward and backward of the per-slot batch) are counted once, after
training, by :class:`torch.utils.flop_counter.FlopCounterMode` on the trial's own ``train_batch`` (no
exchange, no optimizer step: the end-of-run probes' way, :mod:`dtrain.profiling.probes`), as Lightning's
``measure_flops`` does. They are divided by each slot's mean profiled step and by the peak of the run's
precision: on CUDA the matmul throughput the run measured (``device_facts.matmul_tflops``), on CPU a
matmul measured here on the slot's own threads. A measured peak rather than a data sheet's: real matmuls
rarely reach the latter, and an MFU against it would blame the model for the hardware's marketing.
Lightning's ThroughputMonitor and Composer's SpeedMonitor report the same figure.
"""

from __future__ import annotations

import logging
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from dtrain.profiling.modelsteps import restored
from dtrain.profiling.record import DeviceFacts, Flops
from dtrain.profiling.runfacts import ProbeHooks, RunFacts

log = logging.getLogger(__name__)

# The matmul peak that bounds each precision (the keys of device_facts.matmul_tflops).
PEAK_OF = {"32-true": "fp32", "tf32": "tf32", "bf16-mixed": "bf16", "16-mixed": "fp16"}
_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The CPU peak's matmul: big enough to run at the cores' rate, small enough for a few rounds in the budget.
CPU_MATMUL_SIZE = 512
CPU_BUDGET_SECONDS = 0.02


def _one_batch(facts: RunFacts, hooks: ProbeHooks) -> object:
    """A per-slot batch of the run's data on its device (a synthetic run's batch has the same shapes)."""
    loader = hooks.loader
    size = len(loader.dataset)  # type: ignore[arg-type]
    records = [loader.dataset[i % size] for i in range(facts.per_slot_batch_size)]
    return hooks.to_device(loader.collate_fn(records))  # type: ignore[misc]


def count_step_flops(facts: RunFacts) -> float:
    """FLOPs of one training step on this slot, counted once (0.0 where they cannot be counted: no probe
    hooks, a trial that steps its optimizer itself, a parameter server, or any error). Every rank calls it:
    a sharded model's forward gathers from the others."""
    hooks = facts.probe
    if (hooks is None or facts.strategy.has_server_ranks or not facts.models
            or "optimizer" in facts.unobserved_phases):
        return 0.0
    try:
        # The run ends as without the count: buffers (batch norm's), random generators and gradients put back.
        with restored(facts.models, facts.optimizers, facts.device):
            batch = _one_batch(facts, hooks)
            with hooks.gradient_sync(False), FlopCounterMode(display=False) as counter:
                hooks.train_batch(batch, 0, 0)
        return float(counter.get_total_flops())
    except Exception as exc:  # a model the counter cannot follow: no MFU, not a failed run
        log.info("FLOPs not counted: %s", exc)
        return 0.0
    finally:
        facts.timer.exchanging = True


def cpu_matmul_flops_per_second(dtype: torch.dtype, budget: float = CPU_BUDGET_SECONDS) -> float:
    """The best of a few square matmuls in ``dtype`` on this process's threads (FLOP/s)."""
    own = torch.Generator().manual_seed(0)  # not the global generator: the run ends as it would without this
    a = torch.randn(CPU_MATMUL_SIZE, CPU_MATMUL_SIZE, dtype=dtype, generator=own)
    b = torch.randn(CPU_MATMUL_SIZE, CPU_MATMUL_SIZE, dtype=dtype, generator=own)
    a @ b  # warm-up: the library's kernel and its buffers
    best, spent = float("inf"), 0.0
    while spent < budget or best == float("inf"):
        start = time.perf_counter()
        a @ b
        seconds = time.perf_counter() - start
        best, spent = min(best, seconds), spent + seconds
    return 2 * CPU_MATMUL_SIZE**3 / best


def peak_flops_per_second(precision: str, device: DeviceFacts | None) -> tuple[float, str]:
    """The measured matmul peak of ``precision`` on this device (FLOP/s), and what it is, in words."""
    key = PEAK_OF.get(precision, "fp32")
    if device is not None and device.matmul_tflops is not None:
        return device.matmul_tflops.of(key) * 1e12, f"{key} matmul measured on {device.name}"
    threads = torch.get_num_threads()
    return cpu_matmul_flops_per_second(_DTYPE[key]), f"{key} matmul measured on {threads} CPU thread(s)"


def mfu_section(per_rank: list[dict[str, float]], precision: str, device: DeviceFacts | None) -> Flops | None:
    """``flops`` of summary.json and profile.json from every slot's counted FLOPs and mean step (None
    where no slot counted any)."""
    flops = [r.get("step_flops", 0.0) for r in per_rank]
    if not flops or min(flops) <= 0:
        return None
    peak, what = peak_flops_per_second(precision, device)
    per_slot = [f / (r["step"] * peak) if r["step"] > 0 and peak > 0 else 0.0
                for f, r in zip(flops, per_rank, strict=True)]
    return Flops(flops_per_step=flops[0], flops_per_step_all_slots=sum(flops), peak_flops_per_second=peak,
                 peak=what, mfu_per_slot=per_slot, mfu=sum(per_slot) / len(per_slot))
