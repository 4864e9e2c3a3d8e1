"""A Lightning Trainer script (DDP strategy), unchanged for dtrain: forward and backward run inside
``optimizer.step(closure)``, and a validation pass runs between steps (not a step).

    dtrain launch --slots 2 --run-dir runs/trainer examples/scripts/trainer_synthetic.py --steps 12
    DTRAIN_PROFILE=runs/trainer python examples/scripts/trainer_synthetic.py   # the Trainer starts its own processes

CPU and Gloo, synthetic data.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    L.seed_everything(0)
    train = TensorDataset(torch.randn(1024, 32), torch.randint(0, 10, (1024,)))
    val = TensorDataset(torch.randn(128, 32), torch.randint(0, 10, (128,)))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, val_check_interval=6,
                        limit_val_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Classifier(), DataLoader(train, batch_size=args.batch, shuffle=True),
                DataLoader(val, batch_size=args.batch))


if __name__ == "__main__":
    main()
