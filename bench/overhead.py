"""What dtrain costs per step next to a hand-written DDP loop, measured side by side.

    .venv/bin/python bench/overhead.py [--models mlp-0.1m,mlp-1m] [--rounds 5] [--steps 600] [--slots 2]
    .venv/bin/python bench/overhead.py --models gpt --slots 1 --steps 200      # on a GPU

Three ways to train the same model on the same data, each a fresh job of ``--slots`` workers started by
torch's elastic agent (``torch.distributed.run``), 1 CPU thread per worker (``OMP_NUM_THREADS=1``):

* ``raw``: a plain DDP loop (DistributedSampler, DataLoader, ``loss.backward()``, ``opt.step()``);
* ``own``: the same loop through ``dtrain.init()`` (``ctx.setup``, ``ctx.loader``, ``ctx.backward``,
  ``ctx.step_optimizer``);
* ``trial``: a ``PyTorchTrial`` run by dtrain's trainer, profiling on (the default), reports every 100 steps.

Each job times steps ``warmup`` to ``steps - 1`` from the start of one step to the start of another (so
everything between steps counts), device-synchronized at both ends on CUDA. Modes alternate within each
round (raw, own, trial, raw, ...) so that drift on a shared machine hits all alike; the table gives each
mode's median steps/s and the median of its per-round ratios to raw. Goal: >= 0.98 everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
MODES = ("raw", "own", "trial")


# ------------------------------------------------------------------------------------ in a worker


class Window:
    """Start-of-step stamps of step ``warmup`` and of the last step; device-synchronized on CUDA."""

    def __init__(self, warmup: int, steps: int, device: torch.device) -> None:
        self.warmup, self.steps, self.device = warmup, steps, device
        self.start = self.end = 0.0

    def at(self, step: int) -> None:
        if step in (self.warmup, self.steps - 1):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            if step == self.warmup:
                self.start = now
            else:
                self.end = now

    def steps_per_second(self) -> float:
        return (self.steps - 1 - self.warmup) / (self.end - self.start)


def _batches(loader: Any, sampler: Any) -> Any:
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def run_raw(args: argparse.Namespace) -> float:
    import torch.distributed as dist
    from models import loss_of, workload
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model, data, kind = workload(args.model)
    model = model.to(device)
    ddp = DistributedDataParallel(model, device_ids=[local] if cuda else None) if dist.get_world_size() > 1 else model
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True, pin_memory=cuda)
    window = Window(args.warmup, args.steps, device)
    for step, (x, y) in zip(range(args.steps), _batches(loader, sampler), strict=False):
        window.at(step)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = loss_of(kind, ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    dist.destroy_process_group()
    return window.steps_per_second() if rank == 0 else 0.0


def run_own(args: argparse.Namespace) -> float:
    from models import loss_of, workload

    import dtrain

    ctx = dtrain.init(seed=0)
    model, data, kind = workload(args.model)
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    loader = ctx.loader(data, batch_size=args.batch)
    window = Window(args.warmup, args.steps, ctx.device)
    epoch, step = 0, 0
    while step < args.steps:
        ctx.set_epoch(epoch)
        for x, y in loader:
            if step == args.steps:
                break
            window.at(step)
            loss = loss_of(kind, model(ctx.to_device(x)), ctx.to_device(y))
            ctx.backward(loss)
            ctx.step_optimizer(opt)
            step += 1
        epoch += 1
    rank = ctx.rank
    ctx.close()
    return window.steps_per_second() if rank == 0 else 0.0


def make_trial_class() -> type:
    import dtrain

    class BenchTrial(dtrain.PyTorchTrial):
        """The same model and loop as a Trial; times its own window from inside ``train_batch``."""

        def __init__(self, context: dtrain.TrialContext) -> None:
            super().__init__(context)
            from models import workload

            hp = context.get_hparams()
            model, self.data, self.kind = workload(hp["model"])
            self.model = context.wrap_model(model)
            self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9))
            self.window = Window(hp["warmup"], hp["steps"], context.device)
            self.out = Path(hp["out"])

        def build_training_data(self) -> Any:
            return self.data

        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
            from models import loss_of

            self.window.at(batch_idx)
            x, y = batch
            loss = loss_of(self.kind, self.model(x), y)
            self.context.backward(loss)
            self.context.step_optimizer(self.opt)
            if batch_idx == self.window.steps - 1 and self.context.rank == 0:
                self.out.write_text(json.dumps({"steps_per_second": self.window.steps_per_second()}))
            return {"loss": loss}

    return BenchTrial


BenchTrial = make_trial_class() if os.environ.get("DTRAIN_BENCH_TRIAL") else None


def run_trial_mode(args: argparse.Namespace, out: Path) -> float:
    from dtrain.config import config_from_dict
    from dtrain.trainer import run_trial

    run_dir = out.parent / f"run-{out.stem}"  # the same folder on every rank
    run_dir.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = config_from_dict({
        "name": "overhead", "entrypoint": "overhead:BenchTrial", "code_dir": str(HERE),
        "hyperparameters": {"global_batch_size": args.batch * world, "model": args.model, "warmup": args.warmup,
                            "steps": args.steps, "out": str(out)},
        "resources": {"slots_per_trial": world}, "max_length": {"batches": args.steps},
        "checkpoint_storage": {"path": "checkpoints"},
    })
    run_trial(config, run_dir, None, quiet=True)
    return json.loads(out.read_text())["steps_per_second"] if int(os.environ["RANK"]) == 0 else 0.0


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(args.result)
    if args.mode == "trial":
        value = run_trial_mode(args, out.with_suffix(".trial.json"))
    else:
        value = (run_raw if args.mode == "raw" else run_own)(args)
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps({"steps_per_second": value}))


# ------------------------------------------------------------------------------------------ driver


def launch(mode: str, model: str, args: argparse.Namespace, tmp: Path, i: int) -> float:
    result = tmp / f"{model}-{mode}-{i}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTRAIN_BENCH_TRIAL": "1", "PYTHONPATH": str(HERE)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.slots),
           str(Path(__file__)), "--worker", "--mode", mode, "--model", model, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch", str(args.batch), "--result", str(result)]
    subprocess.run(cmd, check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=900)
    return float(json.loads(result.read_text())["steps_per_second"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp-0.1m,mlp-1m")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="per slot")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    print(f"dtrain overhead: {args.slots} slot(s) x 1 thread, batch {args.batch}/slot, steps {args.warmup}.."
          f"{args.steps - 1} timed, {args.rounds} rounds, {device}, torch {torch.__version__}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            runs: dict[str, list[float]] = {m: [] for m in MODES}
            for i in range(args.rounds):
                for mode in MODES:
                    runs[mode].append(launch(mode, model, args, Path(tmp), i))
                print(f"  {model} round {i}: " + ", ".join(f"{m} {runs[m][-1]:.1f}" for m in MODES) + " steps/s",
                      flush=True)
            for mode in MODES:
                ratios = [a / b for a, b in zip(runs[mode], runs["raw"], strict=True)]
                rows.append((model, mode, statistics.median(runs[mode]), statistics.median(ratios),
                             min(ratios), max(ratios)))
    print(f"\n| model | mode | steps/s (median of {args.rounds}) | ratio to raw (median) | min-max |")
    print("|---|---|---|---|---|")
    for model, mode, sps, ratio, lo, hi in rows:
        print(f"| {model} | {mode} | {sps:.1f} | {ratio:.3f} | {lo:.3f}-{hi:.3f} |")


if __name__ == "__main__":
    main()
