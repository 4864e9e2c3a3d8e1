"""What one training step runs: the aten operations of dtrain's loop (the Trainer, profiling on) against a
plain loop on the same tiny model, counted per step by torch.profiler on CPU after a warm-up.

The plain loops are what a user writes: autocast around forward and loss, backward and the optimizer
outside it, and for ``16-mixed`` torch's GradScaler (``scale``, ``step``, ``update``). dtrain may add an
operation to a step only where this file names it and says why: each is work a GPU would have to hide.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from helpers import TRIALS, run_ranks, tiny_config
from trials import stepops

FIRST, STEPS = 8, 6  # steps 0..7 warm up (the optimizer's state, the allocator); steps 8..13 are counted
AUTOCAST = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}

# The loss, read once per step as a Python float for the metric sums: on CPU that is no wait for a device,
# and cheaper than a tensor addition (dtrain.engine.metrics); on an accelerator the loss stays there.
LOSS_READ = Counter({"aten::item": 1, "aten::_local_scalar_dense": 1})
EXTRA = {"32-true": LOSS_READ, "bf16-mixed": LOSS_READ, "16-mixed": LOSS_READ}
# Not extra work but one profiler event less: inside autocast the loss is dispatched twice (autocast's own
# kernel, then the float32 one), and dtrain computes it outside autocast, on the float32 outputs.
FEWER = {"32-true": Counter(), "bf16-mixed": Counter({"aten::cross_entropy_loss": 1}),
         "16-mixed": Counter({"aten::cross_entropy_loss": 1})}


def _per_step(names: list[str]) -> Counter:
    counts = Counter(name for name in names if name.startswith("aten::"))
    assert all(n % STEPS == 0 for n in counts.values()), counts  # whole steps, each alike
    return Counter({name: n // STEPS for name, n in counts.items()})


def _plain_loop(precision: str) -> Counter:
    torch.manual_seed(0)
    model = stepops.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    dtype = AUTOCAST[precision]
    loader = torch.utils.data.DataLoader(stepops.data(), batch_size=32, shuffle=True, drop_last=True)
    profile = stepops.Profile(FIRST, STEPS)
    for step, (x, y) in enumerate(loader):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = stepops.loss_of(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        profile.at_step_end(step)
        if profile.names:
            return _per_step(profile.names)
    raise AssertionError("the loader ran out before the counted steps")


def _dtrain_loop(rank: int, world: int, config: str, run_dir: str) -> None:
    from pathlib import Path

    from dtrain.config.schema import load_config
    from dtrain.engine import precision
    from dtrain.engine.trainer import run_trial

    # 16-mixed is refused on CPU (float16 matmuls there are slow, not wrong); torch's GradScaler works on CPU.
    precision.check_precision = lambda name, device_type: None
    (Path(run_dir) / "logs").mkdir(parents=True)
    run_trial(load_config(Path(config)), Path(run_dir), None, quiet=True)


@pytest.mark.parametrize("precision", list(AUTOCAST))
def test_a_step_runs_the_operations_of_a_plain_loop(tmp_path, precision):
    out = tmp_path / "ops.json"
    (tmp_path / "stepops.py").write_text((TRIALS / "stepops.py").read_text())
    config = tiny_config(tmp_path, entrypoint="stepops:StepOpsTrial", precision=precision,
                         hyperparameters={"global_batch_size": 32, "first": FIRST, "steps": STEPS, "out": str(out)},
                         max_length={"batches": FIRST + STEPS + 1}, scheduling_unit=100,
                         min_validation_period=None, min_checkpoint_period=None,
                         **{"resources.slots_per_trial": 1})
    run_ranks(_dtrain_loop, world_size=1, timeout=90, args=(str(config), str(tmp_path / "run")))
    ours = _per_step(json.loads(out.read_text()))
    plain = _plain_loop(precision)
    assert ours - plain == EXTRA[precision], (ours - plain, plain - ours)
    assert plain - ours == FEWER[precision], (ours - plain, plain - ours)
