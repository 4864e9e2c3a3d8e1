"""The same script on dtrain's own-loop API: docs/porting.md shows the diff and what each change buys.

    dtrain launch --slots 2 examples/porting/dtrain_version.py
    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/porting/dtrain_version.py
    python examples/porting/dtrain_version.py          (one slot)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import dtrain


def digits() -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--max-steps", type=int, help="steps per epoch (default: the whole epoch)")
    parser.add_argument("--snapshot", type=Path, default=Path("snapshots"))
    args = parser.parse_args()

    ctx = dtrain.init(seed=0)

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start_epoch = 0
    if (snapshot := ctx.latest_checkpoint(args.snapshot)) is not None:
        start_epoch = ctx.load_checkpoint(snapshot)["epoch"] + 1
    model, opt = ctx.setup(model, opt)

    loader = ctx.loader(digits(), batch_size=args.batch_size, split="train")

    for epoch in range(start_epoch, args.epochs):
        ctx.set_epoch(epoch)
        for step, (inputs, labels) in enumerate(loader):
            if step == args.max_steps:
                break
            loss = nn.functional.cross_entropy(model(ctx.to_device(inputs)), ctx.to_device(labels))
            ctx.backward(loss)
            ctx.step_optimizer(opt)
        mean_loss = ctx.reduce({"loss": loss})["loss"]
        if ctx.is_chief:
            print(f"epoch {epoch}: loss {mean_loss:.4f} on {ctx.world_size} slot(s)", flush=True)
        ctx.save_checkpoint(args.snapshot, extra={"epoch": epoch})
    ctx.close()


if __name__ == "__main__":
    main()
