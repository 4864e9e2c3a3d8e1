"""What the device can do, measured: the doctor's basis for precision and batch-size advice.

A GPU's data sheet gives peak numbers that real matmuls rarely reach; a few large matmuls on the very
device the run used say what lower precision would buy there (e.g. tensor cores for bf16 / TF32).
"""

from __future__ import annotations

import os
import time

import torch

from dtrain.profiling.record import DeviceFacts, MatmulTflops

MATMUL_SIZE = 4096
MATMUL_REPEATS = 8


def _matmul_tflops(device: torch.device, dtype: torch.dtype, tf32: bool = False) -> float:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=dtype)
        b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=dtype)
        a @ b  # warm-up: cuBLAS picks its kernel
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(MATMUL_REPEATS):
            a @ b
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return 2 * MATMUL_SIZE**3 * MATMUL_REPEATS / seconds / 1e12


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity: a container's or Slurm's share, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def device_facts(device: torch.device) -> DeviceFacts:
    """Name, memory and (CUDA) measured matmul throughput per precision of this rank's device."""
    if device.type != "cuda":
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        page_size = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
        return DeviceFacts(type="cpu", name="cpu", cores=cpu_cores(), total_memory_bytes=float(pages * page_size))
    props = torch.cuda.get_device_properties(device)
    tflops = MatmulTflops(fp32=_matmul_tflops(device, torch.float32),
                          tf32=_matmul_tflops(device, torch.float32, tf32=True),
                          bf16=_matmul_tflops(device, torch.bfloat16), fp16=_matmul_tflops(device, torch.float16))
    return DeviceFacts(type="cuda", name=props.name, capability=f"{props.major}.{props.minor}",
                       # Tensor cores (Volta and later) run fp16; Ampere and later also bf16 and TF32.
                       tensor_cores=props.major >= 7, total_memory_bytes=float(props.total_memory),
                       matmul_tflops=tflops)
