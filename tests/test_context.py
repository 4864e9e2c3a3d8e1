"""The wrap-your-own-loop API on 2 ranks: replicas stay identical, reductions are exact."""

import torch
from helpers import run_ranks
from torch import nn
from torch.utils.data import TensorDataset

import dtrain


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train_and_check_replicas(rank: int, world: int) -> list[float]:
    ctx = dtrain.init(seed=rank)  # different seeds on purpose: DDP must still start replicas identical
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
    model, opt = ctx.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))
    loader = ctx.loader(data, batch_size=8)
    losses = []
    for epoch in range(2):
        ctx.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            ctx.backward(loss)
            ctx.step_optimizer(opt)
            flat = _flat_params(model)
            gathered = [torch.empty_like(flat) for _ in range(world)]
            torch.distributed.all_gather(gathered, flat)
            for other in gathered[1:]:
                assert torch.equal(gathered[0], other), "replicas diverged after a step"
            losses.append(ctx.reduce({"loss": loss})["loss"])
    ctx.close()
    return losses


def test_replicas_identical_after_every_step():
    losses = run_ranks(_train_and_check_replicas, world_size=2, timeout=90)
    assert losses[0] == losses[1]  # reduced metrics agree on every rank
    assert len(losses[0]) == 2 * (96 // 16)


def _exact_weighted_mean(rank: int, world: int) -> dict[str, float]:
    ctx = dtrain.init()
    data = TensorDataset(torch.arange(61, dtype=torch.float64))
    acc_sum, n = 0.0, 0
    for (x,) in ctx.loader(data, batch_size=4, split="eval"):
        acc_sum += float(x.sum())
        n += len(x)
    out = ctx.reduce({"mean": acc_sum / n}, weight=n)
    ctx.close()
    return out


def test_uneven_shards_reduce_to_the_exact_mean():
    results = run_ranks(_exact_weighted_mean, world_size=2, timeout=60)
    assert results[0]["mean"] == results[1]["mean"] == sum(range(61)) / 61
