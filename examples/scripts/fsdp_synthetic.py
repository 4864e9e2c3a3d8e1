"""A torch FSDP2 (``fully_shard``) training script: no DistributedDataParallel model, so a profile of it from
outside sees its data wait, forward, backward and optimizer, and says in one line that its gradient exchange
(inside forward and backward) could not be seen.

    dtrain launch --slots 2 --run-dir runs/fsdp examples/scripts/fsdp_synthetic.py --steps 10

CPU and Gloo, synthetic data.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(1024, 32), torch.randint(0, 10, (1024,)))
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data))
    for step, (x, y) in enumerate(loader, start=1):
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == args.steps:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
