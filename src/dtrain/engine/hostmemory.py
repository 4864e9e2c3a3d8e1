"""Host memory a training process frees every step is kept for the next step, not handed back to the system.

A training step allocates the same large tensors every step (activations, gradients, autocast's copies of
the weights) and frees them by its end. glibc's malloc serves blocks above its mmap threshold (128 KiB at
first, raised only as far as the largest block freed so far) with fresh ``mmap`` pages, and gives the top
of its heap back once more than twice that lies free there; the next step's pages are then new, and the
kernel zeroes each on its first touch. On a CPU that is a page fault per 4 KiB of a step's working memory,
every step; bf16 autocast, which copies every weight at every forward, suffers most
(bench/malloc_cost.py; docs/benchmarks.md). PyTorch's own CPU launcher (``torch.backends.xeon.run_cpu``)
swaps in jemalloc or tcmalloc for the same reason; those need ``LD_PRELOAD`` before the process starts,
which dtrain's forked workers cannot have. ``mallopt`` can be called at any time: both thresholds are
raised, and the heap stays as large as a step's peak, as PyTorch's CUDA caching allocator keeps device
memory.

Left alone where the user chose otherwise: a ``MALLOC_*`` tunable in the environment, or another allocator
preloaded. Elsewhere than glibc (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Mapping

log = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX): larger is refused.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
# Free memory at the top of the heap kept rather than trimmed: above a step's usual peak on the models a CPU
# trains, bounded so that a process that once peaked far higher still gives most of it back.
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024
# The user's own choice of allocator or malloc tuning, which dtrain leaves as it is.
OWN_CHOICE_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def user_choice(environ: Mapping[str, str]) -> str | None:
    """What in ``environ`` says the user tuned or replaced malloc themselves (None: nothing)."""
    for name in OWN_CHOICE_VARIABLES:
        if environ.get(name):
            return name
    preload = environ.get("LD_PRELOAD", "")
    return next((f"LD_PRELOAD={preload}" for lib in OTHER_ALLOCATORS if lib in preload), None)


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Raise glibc malloc's mmap and trim thresholds for this process (see the module's docstring); True
    when they were raised. Never raises."""
    choice = user_choice(os.environ if environ is None else environ)
    if choice is not None:
        log.info("host allocator left as configured (%s)", choice)
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    raised = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD,
                                                                               TRIM_THRESHOLD_BYTES) == 1
    if raised:
        log.info("host allocator: glibc malloc keeps freed memory for the next step (mmap threshold %d MiB, "
                 "trim threshold %d MiB)", MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
    return raised
