"""One slot trains without DDP: no wrapper, no buckets, no hooks (sync/single.py), with the weights a plain
loop and DDP over a world of one give, and a profile without communication."""

import copy
import json

import pytest
import torch
from helpers import tiny_config
from torch import nn

import dtrain
from dtrain.config.schema import load_config
from dtrain.errors import ConfigError
from dtrain.profiling.comm import NULL_RECORDER
from dtrain.sync import registry
from dtrain.sync.ddp import DDPStrategy
from dtrain.sync.single import SingleDeviceStrategy


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _train(model: nn.Module, params: nn.Module, batches, backward, step) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(params.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches:
        backward(nn.functional.mse_loss(model(x), y))
        step(opt)
    return {k: v.detach().clone() for k, v in params.state_dict().items()}


def _plain_step(opt: torch.optim.Optimizer) -> None:
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_one_slot_is_a_plain_loop_and_equals_ddp_over_a_world_of_one():
    ctx = dtrain.init(seed=0, quiet=True)
    try:
        torch.manual_seed(0)
        batches = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(8)]
        start = _model()
        ours, plain, wrapped = copy.deepcopy(start), copy.deepcopy(start), copy.deepcopy(start)
        assert isinstance(ctx.strategy, SingleDeviceStrategy)
        model = ctx.wrap_model(ours)
        # No wrapper, and nothing hooked on the parameters (DDP's reducer hooks every gradient).
        assert model is ours and all(not p._backward_hooks and p._post_accumulate_grad_hooks is None
                                     for p in ours.parameters())
        mine = _train(model, ours, batches, ctx.backward, ctx.step_optimizer)
        reference = _train(plain, plain, batches, torch.Tensor.backward, _plain_step)
        # What a one-slot run would have done with DDP: a one-process all-reduce of every bucket.
        ddp = DDPStrategy(ctx.device).setup_model(wrapped)
        assert isinstance(ddp, nn.parallel.DistributedDataParallel)
        through_ddp = _train(ddp, wrapped, batches, torch.Tensor.backward, _plain_step)
        for name, value in reference.items():
            torch.testing.assert_close(mine[name], value, rtol=0, atol=1e-6)
            torch.testing.assert_close(through_ddp[name], value, rtol=0, atol=1e-6)
        del ddp
    finally:
        ctx.close()


@pytest.mark.parametrize(("strategy", "single"), [("ddp", True), ("allreduce", True), ("local_sgd", False),
                                                  ("fsdp", False)])
def test_which_strategies_one_slot_trains_plainly(tmp_path, strategy, single):
    # No process group here: a world of one. Stood in for, a strategy still reports its own name, gradient
    # compressions, fusion threshold and exchange: dtrain plan predicts it at other slot counts from them.
    config = load_config(tiny_config(tmp_path, **{"sync.strategy": strategy, "resources.slots_per_trial": 1,
                                                  "optimizations.tensor_fusion_threshold": 8.0}))
    built = registry.build(config, torch.device("cpu"), NULL_RECORDER)
    assert isinstance(built, SingleDeviceStrategy) == single
    configured = registry.lookup(strategy)
    assert built.name == strategy and built.compressions == configured.compressions
    assert built.exchange == configured.exchange
    if single:
        assert built.fusion_threshold_mb == 8.0 and not built.exchanges_in_step


def test_single_device_by_name_trains_one_slot_only(tmp_path):
    assert "single_device" not in registry.names()  # dtrain compare runs each listed one on the same slots
    one = load_config(tiny_config(tmp_path, **{"sync.strategy": "single_device", "resources.slots_per_trial": 1}))
    built = registry.build(one, torch.device("cpu"), NULL_RECORDER)
    assert isinstance(built, SingleDeviceStrategy) and built.name == "single_device"
    with pytest.raises(ConfigError, match="trains one slot, the config asks for 2") as err:
        load_config(tiny_config(tmp_path, **{"sync.strategy": "single_device"}))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_one_slot_run_profiles_no_communication(reference_runs):
    profile = json.loads((reference_runs.run_dir(1) / "profile.json").read_text())
    assert profile["strategy"] == "ddp" and profile["slots"] == 1
    assert profile["comm"]["bytes_per_step"] == 0 and profile["comm"]["buckets_per_step"] == 0
    assert profile["seconds_per_step"]["comm_exposed"]["max"] == 0
    assert profile["seconds_per_step"]["step"]["mean"] > 0 and profile["profiled_steps"] > 0
