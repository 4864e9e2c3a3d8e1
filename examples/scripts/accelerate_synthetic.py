"""A Hugging Face Accelerate training script, unchanged for dtrain: ``accelerator.backward`` and
``optimizer.step()``.

    dtrain launch --slots 2 --run-dir runs/accel examples/scripts/accelerate_synthetic.py --steps 12
    torchrun --nproc-per-node 2 -m dtrain.profile --run-dir runs/accel examples/scripts/accelerate_synthetic.py

Run it under dtrain launch or torchrun: ``accelerate launch --num_processes 2 --cpu`` starts one process on a
CPU-only host. CPU and Gloo, synthetic data.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(1024, 32), torch.randint(0, 10, (1024,)))
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=args.batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == args.steps:
                break
    accelerator.wait_for_everyone()
    accelerator.print(f"trained {step} steps")
    accelerator.end_training()


if __name__ == "__main__":
    main()
