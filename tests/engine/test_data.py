import torch
from torch.utils.data import TensorDataset

from dtrain.engine.data import ResumableDistributedSampler, ShardSampler, batches_per_epoch, train_loader


def _global_batches(n_records: int, world: int, per_slot: int, epoch: int = 0) -> list[list[int]]:
    """Indices of each global batch as the union of the per-rank batches at the same step."""
    data = TensorDataset(torch.arange(n_records))
    per_rank = []
    for rank in range(world):
        loader, sampler = train_loader(data, per_slot, rank, world, seed=5)
        sampler.set_start(epoch, 0)
        per_rank.append([b[0].tolist() for b in loader])
    steps = {len(b) for b in per_rank}
    assert len(steps) == 1
    return [sorted(idx for r in range(world) for idx in per_rank[r][i]) for i in range(steps.pop())]


def test_n_slots_see_the_same_global_batches_as_one():
    one = _global_batches(203, 1, 24)
    for world in (2, 3, 4):
        assert _global_batches(203, world, 24 // world) == one
    assert len(one) == batches_per_epoch(range(203), 24) == 203 // 24


def test_epochs_reshuffle_identically_across_world_sizes():
    assert _global_batches(100, 2, 5, epoch=3) == _global_batches(100, 1, 10, epoch=3)
    assert _global_batches(100, 1, 10, epoch=3) != _global_batches(100, 1, 10, epoch=0)


def test_resume_skips_exactly_the_trained_samples():
    data = range(101)
    full = ResumableDistributedSampler(data, num_replicas=2, rank=1, seed=0)
    full.set_start(2, 0)
    resumed = ResumableDistributedSampler(data, num_replicas=2, rank=1, seed=0)
    resumed.set_start(2, 12)
    assert list(resumed) == list(full)[12:]
    assert len(resumed) == len(full) - 12


def test_shard_sampler_covers_every_record_once():
    data = range(61)
    shards = [list(ShardSampler(data, 4, r)) for r in range(4)]
    assert sorted(i for shard in shards for i in shard) == list(range(61))


def test_train_drop_last_false_keeps_the_tail_in_step_on_every_rank():
    data = TensorDataset(torch.arange(23))
    per_rank = []
    for rank in range(2):
        loader, sampler = train_loader(data, 4, rank, 2, seed=1, drop_last=False)
        sampler.set_start(0, 0)
        per_rank.append([b[0].tolist() for b in loader])
    assert [len(b) for b in per_rank[0]] == [len(b) for b in per_rank[1]] == [4, 4, 4]  # 12 each: in step
    seen = [i for batches in per_rank for b in batches for i in b]
    assert sorted(set(seen)) == list(range(23)) and len(seen) == 24  # every record, one repeated as padding


def test_loader_options_are_checked_in_one_line():
    import pytest

    from dtrain.engine.data import loader_options
    from dtrain.errors import DataError

    assert loader_options(num_workers=2, prefetch_factor=4, persistent_workers=True, timeout=5) == {
        "num_workers": 2, "pin_memory": False, "persistent_workers": True, "prefetch_factor": 4, "timeout": 5}
    with pytest.raises(DataError, match="prefetch_factor needs background loader processes"):
        loader_options(prefetch_factor=2)
    with pytest.raises(DataError, match="sets shuffle itself"):
        loader_options(shuffle=True)


def test_first_batch_is_the_loaders_first_without_starting_its_workers():
    import multiprocessing

    from torch.utils.data import Dataset

    from dtrain.engine.data import first_batch

    class Batched(Dataset):  # torch's loader reads a batch at once through __getitems__ where it exists
        def __init__(self):
            self.calls = []

        def __len__(self):
            return 40

        def __getitem__(self, i):
            raise AssertionError("read one by one")

        def __getitems__(self, indices):
            self.calls.append(list(indices))
            return [(torch.tensor([float(i)]), i % 3) for i in indices]

    data = TensorDataset(torch.arange(40.0).unsqueeze(1), torch.arange(40) % 3)
    for dataset in (data, Batched()):
        loader, sampler = train_loader(dataset, 4, 1, 2, seed=5, num_workers=2)
        sampler.set_start(1, 8)  # resumed mid-epoch: the first batch of what is left
        epochs = []
        sampler.on_epoch_start = epochs.append
        children = multiprocessing.active_children()
        batch = first_batch(loader)
        assert multiprocessing.active_children() == children and epochs == [1]
        reference, ref_sampler = train_loader(dataset, 4, 1, 2, seed=5)
        ref_sampler.set_start(1, 8)
        expected = next(iter(reference))
        for got, want in zip(batch, expected, strict=True):
            assert torch.equal(got, want)
    assert len(dataset.calls) == 2 and dataset.calls[0] == dataset.calls[1]
