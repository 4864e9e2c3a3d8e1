"""A plain torch DDP script (no dtrain import), as a torchrun user writes it, for the launcher's tests.

Each rank trains a tiny model on its share of fixed batches (Gloo, CPU) and writes ``OUT/rank<RANK>.json``:
its RANK, WORLD_SIZE and GROUP_RANK as the launcher gave them, its host, and its final weights with their
sum. ``--want-world N``: a rank in a smaller world writes ``OUT/waiting-rank<RANK>.json`` and waits for the
launcher to restart it in a larger one (an elastic job that a node joins), for at most ``--wait`` seconds.

    python -m torch.distributed.run --nproc-per-node 2 tests/scripts/ddp_ranks.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

GLOBAL_BATCH = 16
STEPS = 6
FEATURES = 8


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """Every batch of the run, the same on every rank (and in the tests' single-process reference)."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS * GLOBAL_BATCH, FEATURES, generator=gen)
    return x, x.sum(dim=1, keepdim=True) * 0.5 + 0.1 * torch.randn(len(x), 1, generator=gen)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 4), nn.Tanh(), nn.Linear(4, 1))


def train(net: nn.Module, rank: int, world: int) -> None:
    """SGD on each global batch; this rank takes rows ``rank, rank + world, ...`` of it (the mean of the
    ranks' gradients, which DDP takes, is then the whole batch's)."""
    x, y = data()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for step in range(STEPS):
        rows = slice(step * GLOBAL_BATCH + rank, (step + 1) * GLOBAL_BATCH, world)
        loss = nn.functional.mse_loss(net(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--want-world", type=int, default=0)
    parser.add_argument("--wait", type=float, default=60.0)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world < args.want_world:
        (args.out / f"waiting-rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": world}))
        time.sleep(args.wait)  # the launcher restarts this rank once another node joins
        sys.exit(3)
    dist.init_process_group("gloo")
    assert dist.get_rank() == rank and dist.get_world_size() == world
    net = model()
    train(DDP(net), rank, world)
    weights = [float(v) for p in net.parameters() for v in p.detach().flatten()]
    dist.barrier()
    record = {"rank": rank, "world_size": world, "group_rank": int(os.environ.get("GROUP_RANK", "-1")),
              "host": socket.gethostname(), "weights": weights, "checksum": sum(weights)}
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
