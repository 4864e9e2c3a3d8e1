"""The host allocator keeps a step's freed memory: the next step's is not faulted in anew."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dtrain.engine import hostmemory

# bf16-mixed training steps of an MLP (bench/models.py's mlp-1m): autocast's weight copies, activations and
# gradients, allocated and freed in an order that leaves glibc's defaults trimming the heap every step. 64
# samples: the gradients and weight copies, what is faulted in anew, do not depend on the batch, and bf16 steps
# are slow on a CPU without bf16 units.
STEP = textwrap.dedent("""
    import torch
    from torch import nn
    from dtrain.engine import hostmemory
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 768), nn.ReLU(), nn.Linear(768, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    def faults():
        return int(open("/proc/self/stat").read().split()[9])
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        nn.functional.cross_entropy(out.float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    def faults_per_step():
        # The median step's: now and then the heap grows by a MiB or so (256 pages), which is not a step's
        # memory faulted in anew; the defaults fault over 1,000 pages in every step.
        for _ in range(2):
            step()
        counts = []
        for _ in range(7):
            before = faults()
            step()
            counts.append(faults() - before)
        return sorted(counts)[len(counts) // 2]
    default = faults_per_step()
    if not hostmemory.keep_freed_memory({}):
        raise SystemExit("not raised")
    print(default, faults_per_step())
""")
# Pages of a step's gradients alone (1.06M float32 parameters): what a step that faults its memory in touches
# at the very least.
PAGES_PER_STEP = 1_060_000 * 4 // 4096


@pytest.mark.skipif(not sys.platform.startswith("linux") or hostmemory.platform.libc_ver()[0] != "glibc",
                    reason="glibc malloc only")
def test_freed_step_memory_is_reused_without_page_faults() -> None:
    out = subprocess.run([sys.executable, "-c", STEP], capture_output=True, text=True, timeout=120, check=True)
    default, kept = map(float, out.stdout.split()[-2:])
    assert kept < 0.05 * PAGES_PER_STEP, f"{kept:.0f} page faults per step with the thresholds raised"
    # The default really faults (what the change is for): otherwise the check above proves nothing. Whether it
    # does depends on the host's state: on 2026-11-27, 12 runs alone here faulted 1,500-1,860 pages a step, one
    # fresh-clone CI run none, and hours later 6 runs of 6 had a median of 0 (the kernel may back the heap with
    # huge pages). A precondition of the comparison, not the invariant: it skips, saying so,
    # rather than failing a landing at random. (The mean of 10 steps with the thresholds raised read up to 77
    # pages that day, from the heap growing by a MiB now and then: hence the median step.)
    if default <= 0.5 * PAGES_PER_STEP:
        pytest.skip(f"glibc's defaults faulted {default:.0f} pages per step this time: nothing to compare against")


@pytest.mark.parametrize("environ, choice", [
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1"}, "GLIBC_TUNABLES"),
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "LD_PRELOAD=/usr/lib/libjemalloc.so.2"),
    ({"LD_PRELOAD": "/opt/libfoo.so"}, None),
    ({}, None),
])
def test_a_users_own_malloc_choice_is_left_alone(environ: dict[str, str], choice: str | None) -> None:
    assert hostmemory.user_choice(environ) == choice
    if choice is not None:
        assert not hostmemory.keep_freed_memory(environ)
