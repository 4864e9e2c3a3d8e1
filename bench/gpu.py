"""dtrain on one GPU next to a plain loop: honest throughput, profiler cost, each precision.

    .venv/bin/python bench/gpu.py [--steps 200] [--warmup 30] [--batch 32] [--rounds 3]

Workload: the GPT-like causal LM of bench/models.py (6 layers, d=512, 8 heads, vocab 8192, 256 tokens,
27.4M parameters), batch 32, AdamW lr 3e-4, random tokens, 1 slot on ``cuda:0``.

Rows, run alternately round after round (so drift hits all alike):

* plain loop, fp32 / TF32 / bf16 autocast: pinned memory, non-blocking copies, nothing else;
* ``dtrain run`` with ``precision`` 32-true / tf32 / bf16-mixed / 16-mixed, profiling on, and 32-true with
  profiling off.

Plain loops time steps ``warmup``..``steps`` with a device synchronization at both ends. dtrain rows use
``summary.json``'s ``samples_per_second_all_steps`` (every step over device-synchronized training time)
and, for profiled runs, ``samples_per_second`` (device-timed steady state); both are printed so that
they can be checked against each other. Ratios are to the plain fp32 loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dtrain.profiling.record import load_profile

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ROOT = HERE.parent

TRIAL = '''
import torch
import dtrain
from models import GPT, RandomTokens, lm_loss


class GPTTrial(dtrain.PyTorchTrial):
    def __init__(self, context):
        super().__init__(context)
        self.model = context.wrap_model(GPT())
        self.opt = context.wrap_optimizer(torch.optim.AdamW(self.model.parameters(), lr=3e-4))

    def build_training_data(self):
        return RandomTokens(records=8192)

    def train_batch(self, batch, epoch_idx, batch_idx):
        tokens, targets = batch
        loss = lm_loss(self.model(tokens), targets)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}
'''


def plain_loop(variant: str, steps: int, warmup: int, batch: int) -> float:
    """Samples/s of a hand-written loop: ``fp32``, ``tf32`` or ``bf16`` (autocast around forward+loss)."""
    from models import GPT, RandomTokens, lm_loss

    device = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = variant == "tf32"
    torch.backends.cudnn.allow_tf32 = variant == "tf32"
    torch.manual_seed(0)
    model = GPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loader = torch.utils.data.DataLoader(RandomTokens(records=8192), batch_size=batch, shuffle=True,
                                         drop_last=True, pin_memory=True)
    start, timed = 0.0, 0
    for i, (tokens, targets) in enumerate(loader):
        if i == warmup:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
        if i == steps:
            break
        timed += i >= warmup
        tokens, targets = tokens.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=variant == "bf16"):
            loss = lm_loss(model(tokens), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    if not timed:  # the loader ran out before the warm-up ended
        raise SystemExit(f"--warmup {warmup} leaves no timed step: the loader has {len(loader)} batches")
    return timed * batch / (time.perf_counter() - start)


def dtrain_run(precision: str, profiling: bool, steps: int, warmup: int, batch: int, tmp: Path) -> dict[str, Any]:
    (tmp / "gpt_trial.py").write_text(TRIAL)
    (tmp / "models.py").write_text((HERE / "models.py").read_text())
    config = {"name": "gpu", "entrypoint": "gpt_trial:GPTTrial", "hyperparameters": {"global_batch_size": batch},
              "resources": {"slots_per_trial": 1}, "max_length": {"batches": steps}, "scheduling_unit": 50,
              "precision": precision, "profiling": {"enabled": profiling, "warmup_steps": warmup}}
    import yaml

    cfg = tmp / "gpu.yaml"
    cfg.write_text(yaml.safe_dump(config))
    run_dir = tmp / f"run-{precision}-{profiling}-{time.monotonic_ns()}"
    subprocess.run([sys.executable, "-m", "dtrain.cli", "run", str(cfg), "--run-dir", str(run_dir), "--quiet"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=1200)
    summary = json.loads((run_dir / "summary.json").read_text())
    profile = load_profile(run_dir / "profile.json") if profiling else None
    return {"all_steps": summary["samples_per_second_all_steps"], "steady": summary["samples_per_second"],
            "wall_seconds": summary["wall_seconds"], "train_seconds": summary["train_seconds"],
            "breakdown": {k: v.mean for k, v in profile.seconds_per_step.items()} if profile else {},
            "peak_memory_bytes": max((r.peak_memory_bytes for r in profile.per_rank), default=0) if profile else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU")
    print(f"dtrain GPU bench: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, GPT-like LM, batch "
          f"{args.batch}, steps {args.warmup}..{args.steps}, {args.rounds} rounds", flush=True)
    plain_rows = ("fp32", "tf32", "bf16")
    dtrain_rows = (("32-true", True), ("32-true", False), ("tf32", True), ("bf16-mixed", True), ("16-mixed", True))
    plain: dict[str, list[float]] = {v: [] for v in plain_rows}
    ours: dict[tuple[str, bool], list[dict[str, Any]]] = {r: [] for r in dtrain_rows}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for variant in plain_rows:
                plain[variant].append(plain_loop(variant, args.steps, args.warmup, args.batch))
            for row in dtrain_rows:
                ours[row].append(dtrain_run(*row, args.steps, args.warmup, args.batch, Path(tmp)))
            latest = ours[("32-true", True)][-1]["all_steps"]
            print(f"  round {i}: plain fp32 {plain['fp32'][-1]:,.0f}, dtrain 32-true {latest:,.0f} samples/s",
                  flush=True)
    base = statistics.median(plain["fp32"])
    print("\n| what | samples/s (median) | vs plain fp32 | dtrain: steady (profiled) | wall s | peak GB |")
    print("|---|---|---|---|---|---|")
    for variant in plain_rows:
        value = statistics.median(plain[variant])
        print(f"| plain loop, {variant} | {value:,.0f} | {value / base:.2f} | - | - | - |")
    for (precision, profiling), runs in ours.items():
        value = statistics.median(r["all_steps"] for r in runs)
        steady = statistics.median(r["steady"] for r in runs)
        wall = statistics.median(r["wall_seconds"] for r in runs)
        peak = max(r["peak_memory_bytes"] for r in runs) / 1e9
        print(f"| dtrain, {precision}, profiling {'on' if profiling else 'off'} | {value:,.0f} | {value / base:.2f} | "
              f"{steady:,.0f} | {wall:.1f} | {peak:.2f} |")
    breakdown = ours[("32-true", True)][-1]["breakdown"]
    print("\ndtrain 32-true step breakdown (ms): " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in breakdown.items()))


if __name__ == "__main__":
    main()
