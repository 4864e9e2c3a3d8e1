"""A plain torch DDP training script, as written for torchrun: no dtrain import.

    torchrun --nproc-per-node 2 examples/scripts/ddp_plain.py --steps 20
    dtrain launch --slots 2 --run-dir runs/plain examples/scripts/ddp_plain.py --steps 20
    dtrain doctor runs/plain

Synthetic data on the CPU over Gloo (one process without a launcher), or with `--device cuda` one GPU per process
over NCCL. The options plant what the doctor should
find (a slow loader, a late rank, many small gradient tensors) and the shapes a profiler must handle
(accumulation with ``no_sync``, validation between steps, a crash, no ``destroy_process_group``), and what only
a script shows (accumulation that exchanges on every micro-batch, ``find_unused_parameters=True`` on a model that
uses every parameter, a ``.item()`` every step, loader workers started again every epoch).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset


class SlowDataset(Dataset):
    """Each sample takes ``delay`` seconds to load: a loader that cannot keep up."""

    def __init__(self, base: TensorDataset, delay: float) -> None:
        self.base, self.delay = base, delay

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return self.base[index]


def model_for(args: argparse.Namespace) -> nn.Module:
    if args.many_tensors:  # many small layers: many small gradient tensors
        return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(40)], nn.Linear(32, 10))
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=32, help="per-process batch")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--no-sync", action="store_true", help="accumulate under DDP's no_sync")
    parser.add_argument("--slow-loader", type=float, default=0.0, help="seconds per sample to load")
    parser.add_argument("--late-rank", type=int, default=-1, help="this rank sleeps before each forward")
    parser.add_argument("--late-seconds", type=float, default=0.02)
    parser.add_argument("--many-tensors", action="store_true")
    parser.add_argument("--validate-every", type=int, default=0, help="a validation pass every N steps")
    parser.add_argument("--crash-at", type=int, default=-1, help="rank 1 raises at this step")
    parser.add_argument("--keep-group", action="store_true", help="never call destroy_process_group")
    parser.add_argument("--save", default="", help="rank 0 saves the model's state dict here")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--persistent", action="store_true", help="keep the loader's workers between epochs")
    parser.add_argument("--find-unused", action="store_true", help="DDP searches for unused parameters")
    parser.add_argument("--item", action="store_true", help="read the loss on the host every step")
    parser.add_argument("--samples", type=int, default=2048, help="samples in the data set (an epoch)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per process")
    args = parser.parse_args()

    launched = "RANK" in os.environ
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if launched:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if launched else 0
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 32, generator=torch.Generator().manual_seed(1)),
                         torch.randint(0, 10, (args.samples,), generator=torch.Generator().manual_seed(2)))
    dataset: Dataset = SlowDataset(data, args.slow_loader) if args.slow_loader > 0 else data
    sampler = DistributedSampler(dataset, shuffle=True, seed=3) if launched else None
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, shuffle=False, num_workers=args.workers,
                        persistent_workers=args.persistent and args.workers > 0)
    model = model_for(args).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None,
                                  find_unused_parameters=args.find_unused) if launched else model
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    step, epoch = 0, 0
    while step < args.steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        batches = iter(loader)
        while step < args.steps:
            micro = []
            for _ in range(args.accumulate):
                batch = next(batches, None)
                if batch is None:
                    break
                micro.append(batch)
            if len(micro) < args.accumulate:
                break
            for i, (x, y) in enumerate(micro):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if rank == args.late_rank:
                    time.sleep(args.late_seconds)
                last = i == len(micro) - 1
                syncing = contextlib.nullcontext() if last or not args.no_sync or not launched else ddp.no_sync()
                with syncing:
                    loss = loss_fn(ddp(x), y) / args.accumulate
                    loss.backward()
            if args.item:
                loss.item()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if rank == 1 and step == args.crash_at:
                raise RuntimeError(f"planted failure at step {step}")
            if args.validate_every and step % args.validate_every == 0:
                with torch.no_grad():
                    for j, (x, y) in enumerate(loader):
                        loss_fn(ddp(x.to(device)), y.to(device))
                        if j == 3:
                            break
        epoch += 1
    if rank == 0 and args.save:
        torch.save(model.state_dict(), args.save)
    if launched and not args.keep_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
