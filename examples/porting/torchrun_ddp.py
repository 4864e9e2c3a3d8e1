"""A plain PyTorch DDP script, as torchrun users write it: the starting point of docs/porting.md.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/porting/torchrun_ddp.py
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def digits() -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--max-steps", type=int, help="steps per epoch (default: the whole epoch)")
    parser.add_argument("--snapshot", type=Path, default=Path("snapshot.pt"))
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start_epoch = 0
    if args.snapshot.exists():
        snapshot = torch.load(args.snapshot, map_location=device, weights_only=True)
        model.load_state_dict(snapshot["model"])
        opt.load_state_dict(snapshot["optimizer"])
        start_epoch = snapshot["epoch"] + 1
    model = DDP(model, device_ids=[local_rank] if cuda else None)

    dataset = digits()
    sampler = DistributedSampler(dataset, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True, pin_memory=cuda)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for step, (inputs, labels) in enumerate(loader):
            if step == args.max_steps:
                break
            loss = nn.functional.cross_entropy(model(inputs.to(device)), labels.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world_size
        if rank == 0:
            print(f"epoch {epoch}: loss {mean_loss.item():.4f} on {world_size} slot(s)", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                       args.snapshot)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
