"""DDP's bucket layout as the cost model lays it out (profiling/buckets.py) is torch's own: the same buckets as
torch's assignment on random tensor sizes and caps, and as a real DDP reports after its rebuild; a run records
its gradient tensors, and a model whose gradients cross 1 MiB in few tensors is priced one bucket, not two."""

from __future__ import annotations

import gc
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtrain import dist as ddist
from dtrain.profiling import buckets
from dtrain.profiling.buckets import gradient_bytes


def _torchs(tensor_bytes: list[int], cap_mb: float | None) -> list[int]:
    """torch's assignment of float32 tensors of ``tensor_bytes`` with DDP's limits for ``cap_mb``."""
    tensors = [torch.empty(n // 4, device="meta") for n in tensor_bytes]
    first, cap = buckets.limits(cap_mb)
    limits = [int(first), int(cap)] if first < cap else [int(cap)]
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
    return [sum(tensor_bytes[i] for i in bucket) for bucket in indices]


@pytest.mark.parametrize("cap_mb", [None, 0.5, 1.0, 4.0, 25.0])
def test_the_layout_is_torchs_on_random_models(cap_mb):
    rng = random.Random(7)
    for _ in range(50):
        sizes = [4 * rng.choice([1, 10, 480, 4800, 65_536, 230_400, 1_000_000, 3_000_000])
                 for _ in range(rng.randint(1, 30))]
        assert buckets.layout(sizes, cap_mb) == _torchs(sizes, cap_mb), sizes


@pytest.mark.skipif(dist.is_initialized(), reason="a process group is already up in this process")
def test_the_layout_is_what_a_real_ddp_made_after_its_rebuild(tmp_path):
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    ddp = None
    try:
        for cap_mb in (64.0, 0.5, 0.1, None):
            model = nn.Sequential(nn.Linear(64, 480), nn.ReLU(), nn.Linear(480, 480), nn.ReLU(), nn.Linear(480, 10))
            ddp = DistributedDataParallel(model, bucket_cap_mb=cap_mb)
            for _ in range(2):  # DDP lays its buckets out again by backward's order after its first iteration
                ddp(torch.randn(4, 64)).sum().backward()
            made = [b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets()]
            assert made == buckets.layout(gradient_bytes([model])[0], cap_mb), cap_mb
    finally:
        # The last DDP's Reducer holds the group: freed after the group is destroyed (when this function returned),
        # the group's destructor joined Gloo's threads while holding the GIL they wait for, and the suite hung
        # (seen once in a fresh-clone CI run). Freed first, while the default group still holds it.
        del ddp
        gc.collect()
        ddist.destroy_process_group()


def test_a_cap_of_zero_is_one_bucket_per_tensor():
    assert buckets.layout([40, 400, 4000], 0.0) == [40, 400, 4000]


def test_a_model_records_its_gradients_in_backwards_order_and_ddp_buckets_them_so():
    # digits' MLP at hidden 480: 1.02 MiB of gradients in 6 tensors, one bucket at any cap of 1 MiB or more.
    model = nn.Sequential(nn.Linear(64, 480), nn.ReLU(), nn.Linear(480, 480), nn.ReLU(), nn.Linear(480, 10))
    model[0].bias.requires_grad_(False)
    [recorded] = gradient_bytes([model])
    assert recorded == [40, 19_200, 1_920, 921_600, 122_880]  # last layer first, the frozen bias left out
    assert buckets.layout(recorded, 64.0) == buckets.layout(recorded, None) == [sum(recorded)]
    assert buckets.layout(recorded, 0.5) == [942_760, 122_880] == _torchs(recorded, 0.5)


def test_the_cost_model_prices_the_recorded_layout_and_keeps_the_old_rule_without_it():
    from profiles import make_profile

    from dtrain.explain.costmodel import CostModel

    tensors = [40, 19_200, 1_920, 921_600, 1_920, 122_880]
    base = make_profile([{"forward": 0.01, "backward": 0.02}], parameters=sum(tensors) // 4,
                        tensor_fusion_threshold_mb=64.0)
    recorded = CostModel.from_profile(base.model_copy(update={"gradient_bytes": [tensors]}))
    nbytes = float(sum(tensors))
    assert recorded.buckets(nbytes, False) == [nbytes]  # one bucket: the run's DDP made one
    halves = recorded.buckets(nbytes / 2, False, 0.5)  # fp16: the same layout, each bucket half as big
    assert halves == pytest.approx([b / 2 for b in buckets.layout(tensors, 0.5)])
    assert len(recorded.buckets(nbytes, False, 0.0)) == len(tensors)
    # A profile from before the tensors were recorded: fine-grained tensors at the run's cap (64 MB: one).
    assert len(CostModel.from_profile(base).buckets(nbytes, False)) == 1


def test_frozen_parameters_are_not_priced_as_exchanged():
    """A fine-tuned model whose backbone is frozen exchanges its trainable gradients only (DDP buckets only
    those): a profile that records them prices that, one without them every parameter."""
    from profiles import make_profile

    from dtrain.explain.costmodel import CostModel, Target

    points = [(4096.0, 1e-4), (float(2**20), 1e-3), (float(8 * 2**20), 7e-3)]
    whole = make_profile([{"forward": 0.01, "backward": 0.02}], parameters=1_000_000, tensor_fusion_threshold_mb=64.0)
    tuned = whole.model_copy(update={"gradient_bytes": [[40_000, 360_000]]})  # a tenth of it trains
    exchange = {}
    for name, profile in (("whole", whole), ("tuned", tuned)):
        model = CostModel.from_profile(profile, points, 2, 0.0)
        exchange[name] = model.predict(Target(2)).parts["exchange"]
    assert CostModel.from_profile(tuned).facts.gradient_total == 400_000
    assert exchange["tuned"] < exchange["whole"] / 2
