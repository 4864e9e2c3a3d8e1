"""Your own training loop on N slots: `dtrain launch --slots 2 examples/own_loop/train.py`
(or `torchrun --nproc-per-node 2 examples/own_loop/train.py`; a plain `python` run is one slot)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import dtrain


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per slot")
    parser.add_argument("--checkpoint-dir", type=Path)
    args = parser.parse_args()

    ctx = dtrain.init(seed=0)
    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y))
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loader = ctx.loader(data, batch_size=args.batch_size, split="train")

    start_epoch = 0
    if args.checkpoint_dir is not None and (found := ctx.latest_checkpoint(args.checkpoint_dir)) is not None:
        start_epoch = ctx.load_checkpoint(found)["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        ctx.set_epoch(epoch)
        for inputs, labels in loader:
            loss = nn.functional.cross_entropy(model(ctx.to_device(inputs)), ctx.to_device(labels))
            ctx.backward(loss)
            ctx.step_optimizer(opt)
        mean_loss = ctx.reduce({"loss": loss})["loss"]  # every rank calls it: it is a collective
        if ctx.is_chief:
            print(f"epoch {epoch}: loss {mean_loss:.4f} on {ctx.world_size} slot(s)", flush=True)
        if args.checkpoint_dir is not None:  # on every rank: saving is collective
            ctx.save_checkpoint(args.checkpoint_dir, extra={"epoch": epoch})
    ctx.close()


if __name__ == "__main__":
    main()
