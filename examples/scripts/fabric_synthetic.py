"""A Lightning Fabric training script, unchanged for dtrain: ``fabric.backward`` and ``optimizer.step()``.

    dtrain launch --slots 2 --run-dir runs/fabric examples/scripts/fabric_synthetic.py --steps 12
    torchrun --nproc-per-node 2 -m dtrain.profile --run-dir runs/fabric examples/scripts/fabric_synthetic.py

Under a launcher (torchrun, dtrain launch) Fabric joins the launcher's processes; alone it starts its own two
(then profile it with DTRAIN_PROFILE=DIR). CPU and Gloo, synthetic data.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0)
    data = TensorDataset(torch.randn(1024, 32), torch.randint(0, 10, (1024,)))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch, shuffle=True))
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            step += 1
            if step == args.steps:
                break
    fabric.print(f"trained {step} steps")


if __name__ == "__main__":
    main()
