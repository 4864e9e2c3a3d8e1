"""A strategy plugs in by registering itself: this file adds one without touching dtrain's modules."""

import re

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks, tiny_config

from dtrain.config.schema import load_config
from dtrain.errors import ConfigError
from dtrain.sync import registry
from dtrain.sync.base import SyncStrategy, broadcast_from_chief


@registry.register
class ToyStrategy(SyncStrategy):
    """Averages each gradient with its own all-reduce after backward: the simplest synchronous strategy."""

    name = "toy"
    exchanges_in_step = True
    exchanges = 0

    def setup_model(self, model):
        model = model.to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            broadcast_from_chief(model)
        return model

    def exchange_gradients(self, optimizer):
        world = dist.get_world_size() if dist.is_initialized() else 1
        for group in optimizer.param_groups:
            for p in group["params"]:
                with self.recorder.collective(p.grad.numel() * p.grad.element_size()):
                    dist.all_reduce(p.grad)
                p.grad.div_(world)
        ToyStrategy.exchanges += 1


def _train_with_toy(rank, world, folder):
    from dtrain.engine.trainer import run_trial

    config = load_config(folder / "experiment.yaml")
    summary = run_trial(config, folder / "run", None, quiet=True)
    return {"exchanges": ToyStrategy.exchanges, "summary": summary}


@pytest.mark.slow
def test_a_registered_strategy_trains_like_ddp(tmp_path, reference_runs):
    cfg = tiny_config(tmp_path, **{"sync.strategy": "toy"})
    (tmp_path / "run").mkdir()
    results = run_ranks(_train_with_toy, world_size=2, timeout=90, args=(tmp_path,))
    assert [r["exchanges"] for r in results] == [24, 24]
    assert results[0]["summary"]["strategy"] == "toy"
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    toy = torch.load(tmp_path / "run" / "checkpoints" / latest / "model.pt", weights_only=True)
    for name, expected in reference_runs.weights(2).items():
        torch.testing.assert_close(toy[name], expected, rtol=1e-5, atol=1e-6)
    assert "toy" in registry.names() and load_config(cfg).sync.strategy == "toy"


def test_capabilities_are_checked_from_the_registry(tmp_path):
    cfg = tiny_config(tmp_path, **{"sync.strategy": "toy", "optimizations.gradient_compression": "fp16"})
    with pytest.raises(ConfigError, match=re.escape("sync.strategy 'toy' cannot honour gradient_compression 'fp16'")):
        load_config(cfg)
    with pytest.raises(ConfigError, match=re.escape("sync.strategy: got 'tyo'; expected one of 'ddp', ")):
        load_config(tiny_config(tmp_path, **{"sync.strategy": "tyo"}))
