"""How a GPU step should be timed to predict a run's step: one step between two synchronizations, chains of
consecutive steps, or a long consecutive loop (the run's own way), per precision, on the GPT-like LM of
bench/models.py (batch 32, AdamW, one batch kept on the device).

    python bench/gpu_probe.py [--json FILE] [--rounds 2]

Issue 45: the model-step probe (dtrain.profiling.modelsteps) timed one step between two synchronizations and
read 14.8 ms for bf16 where the run's steps took 18.4 ms. Each variant here is the step the plain loop of
bench/gpu.py takes; the figures are seconds per step, and their ratios to fp32 are the precision gains each
method would predict. Rows alternate round by round. ``fp16`` steps through a GradScaler as a 16-mixed run
does. ``loop+copy``: the loop with the batch copied from pinned host memory at every step (non-blocking).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import plain_step
from models import GPT, RandomTokens

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Stepper:
    """One precision's model, optimizer and step (the state carries on from step to step, as in training)."""

    def __init__(self, precision: str, device: torch.device, batch: int) -> None:
        torch.manual_seed(0)
        self.precision, self.device = precision, device
        self.model = GPT().to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        data = RandomTokens(records=batch)
        tokens, targets = zip(*(data[i] for i in range(batch)), strict=True)
        self.host = (torch.stack(tokens).pin_memory(), torch.stack(targets).pin_memory())
        self.batch = tuple(t.to(device) for t in self.host)

    def step(self, copy: bool = False) -> None:
        torch.backends.cuda.matmul.allow_tf32 = self.precision == "tf32"
        tokens, targets = (tuple(t.to(self.device, non_blocking=True) for t in self.host) if copy
                           else self.batch)
        plain_step(self.model, self.opt, self.scaler, DTYPE.get(self.precision), tokens, targets)


def _timed(stepper: Stepper, steps: int, copy: bool = False) -> tuple[float, float]:
    """Seconds per step over ``steps`` consecutive steps between two synchronizations, and the host's
    seconds per step until the last one was queued."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        stepper.step(copy)
    queued = time.perf_counter()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / steps, (queued - began) / steps


def measure(stepper: Stepper) -> dict[str, Any]:
    singles = [_timed(stepper, 1) for _ in range(15)]
    chains = [_timed(stepper, 4)[0] for _ in range(6)]
    return {"loop": _timed(stepper, 60)[0], "loop+copy": _timed(stepper, 60, copy=True)[0],
            "single_median": statistics.median(s for s, _ in singles),
            "single_mean": statistics.fmean(s for s, _ in singles),
            "single_host_median": statistics.median(h for _, h in singles),
            "chain4_median": statistics.median(chains), "chain4_mean": statistics.fmean(chains)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_probe.py needs a CUDA GPU")
    device = torch.device("cuda", 0)
    steppers = {p: Stepper(p, device, args.batch) for p in PRECISIONS}
    for stepper in steppers.values():  # first launches of every precision's kernels, out of the figures
        _timed(stepper, 10)
    rounds: list[dict[str, dict[str, Any]]] = []
    for _ in range(args.rounds):
        rounds.append({p: measure(s) for p, s in steppers.items()})
        if args.json is not None:
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rounds": rounds}, indent=2))
    methods = list(rounds[0]["fp32"])
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: ms per step (gain over fp32), "
          f"median of {args.rounds} rounds")
    print("| method | " + " | ".join(PRECISIONS) + " |")
    print("|---|" + "---|" * len(PRECISIONS))
    for method in methods:
        ms = {p: statistics.median(r[p][method] for r in rounds) * 1e3 for p in PRECISIONS}
        print(f"| {method} | " + " | ".join(f"{ms[p]:.2f} ({ms['fp32'] / ms[p]:.2f}x)" for p in PRECISIONS) + " |")


if __name__ == "__main__":
    main()
