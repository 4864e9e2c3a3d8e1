"""dtrain's fixed cost per step in CPU instructions: a count that the machine's speed does not move.

    .venv/bin/python bench/step_instructions.py [--model mlp-tiny] [--steps 300,1300] [--slots 1]

Timing a few percent on a shared 2-core machine is noise-bound (bench/overhead.py's rounds spread by
+/-20%); the number of instructions a step executes is not. This runs the same 1-slot training three ways
(``raw``: a plain loop; ``own``: through ``dtrain.init()``; ``trial``: a PyTorchTrial under dtrain's
trainer, profiling on) under valgrind's cachegrind (``--cache-sim=no``: instruction counts only), each at
two step counts, and prints the difference divided by the extra steps: instructions per step, start-up
and end of run cancelled out. Needs ``valgrind`` (``apt-get install valgrind``); about 2 minutes per run
(6 runs). On one slot there is no communication: what remains is the work each mode does around the
model's own forward, backward and update, i.e. its fixed cost per step. With ``--slots 2`` every rank runs
under cachegrind (Gloo, the raw loop with DDP and a DistributedSampler) and rank 0's count is reported:
what a mode adds where gradients are exchanged (comm timing, reports' collectives). Waiting for the peer
blocks in the kernel, so it adds no instructions; Gloo's own work is in every mode alike. The Trial's stop
votes are left out: they follow wall time, so under valgrind they would come every step instead of every
~2 s. Instructions are not time: two identical jobs of the same code can run a few percent apart
(``bench/overhead.py --control``), a difference a count does not see.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
MODES = ("raw", "own", "trial")
BATCH = 32


def run_raw(model_name: str, steps: int) -> None:
    import torch.distributed as dist
    from models import loss_of, workload
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model, data, kind = workload(model_name)
    sampler = None
    if world > 1:
        dist.init_process_group("gloo")
        model = DistributedDataParallel(model)
        sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(data, batch_size=BATCH, shuffle=sampler is None, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            if step == steps:
                break
            loss = loss_of(kind, model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
        epoch += 1
    if world > 1:
        dist.destroy_process_group()


def run_own(model_name: str, steps: int) -> None:
    from models import loss_of, workload

    import dtrain

    ctx = dtrain.init(seed=0)
    model, data, kind = workload(model_name)
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    loader = ctx.loader(data, batch_size=BATCH)
    step, epoch = 0, 0
    while step < steps:
        ctx.set_epoch(epoch)
        for x, y in loader:
            if step == steps:
                break
            loss = loss_of(kind, model(ctx.to_device(x)), ctx.to_device(y))
            ctx.backward(loss)
            ctx.step_optimizer(opt)
            step += 1
        epoch += 1
    ctx.close()


def run_trial(model_name: str, steps: int, trial_config: str = "{}") -> None:
    import dtrain.engine.stopping
    from dtrain.config.schema import config_from_dict
    from dtrain.engine.trainer import run_trial as train

    # Stop votes come every TARGET_SECONDS of wall time: on a real run every few hundred steps, under
    # valgrind (hundreds of times slower) every step, which would count a vote per step (on one slot,
    # 0.1M MLP: 62,861 instructions per step with the votes' former tensor indexing). Left out of the count.
    dtrain.engine.stopping.TARGET_SECONDS = 1e9
    world = int(os.environ["WORLD_SIZE"])
    config = config_from_dict({
        "name": "step-instructions", "entrypoint": "trials.workload:WorkloadTrial", "code_dir": str(HERE),
        "hyperparameters": {"global_batch_size": BATCH * world, "model": model_name},
        "resources": {"slots_per_trial": world}, "max_length": {"batches": steps},
        "checkpoint_storage": {"path": "checkpoints"}, **json.loads(trial_config),
    })
    # Every rank writes into the same folder (the driver's, like a launcher's run directory).
    train(config, Path(os.environ["STEP_INSTRUCTIONS_RUN"]), None, quiet=True)


def instructions(mode: str, model: str, steps: int, slots: int, port: int, trial_config: str = "{}",
                 native_peers: bool = False) -> int:
    """Instructions executed by rank 0's whole run (cachegrind's ``I refs``); every rank runs under it
    unless ``native_peers`` (then only rank 0: faster, and rank 0's count is the same)."""
    # The caller's PYTHONPATH is kept after this folder: e.g. an older checkout's src, to compare commits.
    path = os.pathsep.join(filter(None, (str(HERE), os.environ.get("PYTHONPATH"))))
    with tempfile.TemporaryDirectory() as tmp:
        # PYTHONHASHSEED fixed, so that a run repeats exactly: string hashes decide how long dict lookups
        # probe (the own loop, 0.1M MLP, 300 steps: 11,480,954,877 instructions with a random seed,
        # 11,499,227,666 with seed 0).
        base = {**os.environ, "OMP_NUM_THREADS": "1", "DTRAIN_REPORT": "0", "PYTHONPATH": path, "PYTHONHASHSEED": "0",
                "WORLD_SIZE": str(slots), "LOCAL_WORLD_SIZE": str(slots), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "STEP_INSTRUCTIONS_RUN": tmp}
        ranks = []
        for rank in range(slots):
            valgrind = ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={tmp}/out-{rank}"]
            cmd = [*(valgrind if rank == 0 or not native_peers else []), sys.executable, str(Path(__file__)),
                   "--worker", mode, "--model", model, "--steps", str(steps), "--trial-config", trial_config]
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            log = open(f"{tmp}/log-{rank}", "w+")  # noqa: SIM115 (closed below, after the wait)
            ranks.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log, text=True), log))
        outputs = []
        for proc, log in ranks:
            code = proc.wait()
            log.seek(0)
            outputs.append((code, log.read()))
            log.close()
    code, text = outputs[0]
    found = re.search(r"I\s+refs:\s+([\d,]+)", text)
    failed = [out for c, out in outputs if c != 0]
    if failed or found is None:
        raise SystemExit(f"{mode} ({steps} steps) failed:\n{(failed or [text])[0][-3000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp-tiny")
    parser.add_argument("--steps", default="300,1300", help="the two step counts (their difference counts)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--slots", type=int, default=1, choices=(1, 2), help="ranks (Gloo); rank 0 is counted")
    parser.add_argument("--native-peers", action="store_true", help="ranks other than 0 run without valgrind")
    parser.add_argument("--trial-config", default="{}",
                        help='JSON merged into the Trial\'s config, e.g. \'{"profiling": {"enabled": false}}\'')
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)
        if args.worker == "trial":
            run_trial(args.model, int(args.steps), args.trial_config)
        else:
            {"raw": run_raw, "own": run_own}[args.worker](args.model, int(args.steps))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found: apt-get install valgrind")
    short, long = (int(s) for s in args.steps.split(","))
    print(f"instructions per step, {args.model}, {args.slots} slot(s), rank 0, batch {BATCH} per slot, "
          f"torch {torch.__version__} (cachegrind, runs of {short} and {long} steps)", flush=True)
    per_step = {}
    for i, mode in enumerate(args.modes.split(",")):
        counts = [instructions(mode, args.model, steps, args.slots, 29600 + 2 * i + j, args.trial_config,
                               args.native_peers)
                  for j, steps in enumerate((short, long))]
        per_step[mode] = (counts[1] - counts[0]) / (long - short)
        print(f"  {mode}: {counts[0]:,} and {counts[1]:,} instructions", flush=True)
    base = per_step.get("raw")
    print("\n| mode | instructions per step | vs raw |\n|---|---|---|")
    for mode, count in per_step.items():
        print(f"| {mode} | {count:,.0f} | {count / base:.3f} |" if base else f"| {mode} | {count:,.0f} | |")


if __name__ == "__main__":
    main()
