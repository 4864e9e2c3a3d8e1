"""A DDP script that starts its own processes with ``torch.multiprocessing.spawn`` (no launcher): profile it
with ``DTRAIN_PROFILE=DIR``, which reaches the spawned processes through dtrain's ``.pth`` file.

    DTRAIN_PROFILE=runs/spawn python examples/scripts/spawn_ddp.py --steps 10

CPU and Gloo, synthetic data; the group is never destroyed (the figures are gathered as each process exits).
"""

from __future__ import annotations

import argparse
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def work(rank: int, world: int, port: int, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(1024, 16), torch.randn(1024, 1))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data))
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(loader, start=1):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == steps:
            break


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:  # a free port for the group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(work, args=(args.nprocs, port, args.steps), nprocs=args.nprocs)


if __name__ == "__main__":
    main()
