"""The wrap-your-own-loop API on 2 ranks: replicas stay identical, reductions are exact."""

import pytest
import torch
from helpers import run_ranks
from torch import nn
from torch.utils.data import TensorDataset

import dtrain
from dtrain.engine.data import ShardSampler
from dtrain.errors import UserError


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


@pytest.mark.slow
def test_replicas_identical_after_every_step():
    losses = run_ranks(_train_and_check_replicas, world_size=2, timeout=90)
    assert losses[0] == losses[1]  # reduced metrics agree on every rank
    assert len(losses[0]) == 2 * (96 // 16)


def _exact_weighted_mean(ctx: dtrain.DistributedContext) -> dict[str, float]:
    data = TensorDataset(torch.arange(61, dtype=torch.float64))
    acc_sum, n = 0.0, 0
    for (x,) in ctx.loader(data, batch_size=4, split="eval"):
        acc_sum += float(x.sum())
        n += len(x)
    return ctx.reduce({"mean": acc_sum / n}, weight=n)


def _two_rank_checks(rank: int, world: int, directory: str) -> dict:
    # One pair of processes for two checks: spawning ranks costs seconds each time on a small machine.
    ctx = dtrain.init(seed=0, quiet=True)
    out = {"mean": _exact_weighted_mean(ctx)}
    out.update(_rank0_only_save(ctx, rank, directory))
    ctx.close()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("two_ranks") / "ckpt"
    return run_ranks(_two_rank_checks, world_size=2, timeout=90, args=(str(directory),)), directory


@pytest.mark.slow
def test_uneven_shards_reduce_to_the_exact_mean(two_ranks):
    results, _ = two_ranks
    assert results[0]["mean"] == results[1]["mean"] == {"mean": sum(range(61)) / 61}


def _rank0_only_save(ctx: dtrain.DistributedContext, rank: int, directory: str) -> dict:
    """The DDP tutorial's `if rank == 0: save()`, ported as is: rank 0 must learn it in seconds."""
    import time

    from dtrain.engine.rollcall import SaveMismatchError

    model = nn.Linear(4, 2)
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    loader = ctx.loader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)), 4)

    def epoch(e: int) -> None:
        ctx.set_epoch(e)
        for x, y in loader:
            ctx.backward(nn.functional.mse_loss(model(x), y))
            ctx.step_optimizer(opt)

    out: dict = {}
    epoch(0)
    if rank == 0:  # rank 1 goes on to epoch 1 and blocks in its first all-reduce
        start = time.monotonic()
        try:
            ctx.save_checkpoint(directory)
        except SaveMismatchError as exc:
            out["moved_on"] = (str(exc), time.monotonic() - start)
    epoch(1)  # rank 0 joins rank 1's step: both go on
    if rank == 0:  # rank 1 closes meanwhile
        start = time.monotonic()
        try:
            ctx.save_checkpoint(directory)
        except SaveMismatchError as exc:
            out["closed"] = (str(exc), time.monotonic() - start)
    else:
        ctx.close()  # what rank 0 sees while it waits in its second save
    return out


@pytest.mark.slow
def test_saving_on_rank0_only_fails_in_seconds_with_one_line(two_ranks):
    (out, other), directory = two_ranks
    assert set(other) == {"mean"}
    for case, evidence in (("moved_on", "rank(s) 1 (it started epoch 1)"), ("closed", "(it closed its context)")):
        message, seconds = out[case]
        assert seconds < 10, (case, seconds)  # not the 300 s collective timeout
        assert "\n" not in message and "is collective" in message and evidence in message, message
        assert "call it on every rank" in message
    assert dtrain.DistributedContext.latest_checkpoint(directory) is None  # nothing half-written


def _model_and_opt(ctx):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    return model, opt


def test_load_before_or_after_setup_restores_the_same_state(tmp_path):
    from dtrain.errors import CheckpointError

    ctx = dtrain.init(seed=4, quiet=True)
    try:
        assert ctx.latest_checkpoint(tmp_path / "none") is None
        model, opt = ctx.setup(*_model_and_opt(ctx))
        data = TensorDataset(torch.randn(24, 3), torch.randn(24, 1))
        for x, y in ctx.loader(data, batch_size=8):
            ctx.backward(nn.functional.mse_loss(model(x), y))
            ctx.step_optimizer(opt)
        saved = ctx.save_checkpoint(tmp_path / "ckpt", extra={"epoch": 0})
        assert saved.name == "3" and ctx.latest_checkpoint(tmp_path / "ckpt") == saved  # named by steps taken
        (tmp_path / "ckpt" / ".tmp-9").mkdir()  # an unfinished save is never "latest"
        assert ctx.latest_checkpoint(tmp_path / "ckpt") == saved
        expected = {k: v.clone() for k, v in ctx.unwrap(model).state_dict().items()}
        ctx.models.clear(), ctx.optimizers.clear()

        assert ctx.load_checkpoint(saved) == {"epoch": 0}  # before setup: applied when wrapped
        before_model, before_opt = ctx.setup(*_model_and_opt(ctx))
        assert ctx.optimizer_steps == 3
        ctx.models.clear(), ctx.optimizers.clear()
        after_model, after_opt = ctx.setup(*_model_and_opt(ctx))
        ctx.load_checkpoint(tmp_path / "ckpt")  # after setup, from the folder holding `latest`
        for restored, opt in ((before_model, before_opt), (after_model, after_opt)):
            for key, value in ctx.unwrap(restored).state_dict().items():
                assert torch.equal(value, expected[key]), key
            assert opt.state_dict()["state"][0]["step"] == 3
        ctx.models.clear(), ctx.optimizers.clear()

        ctx.load_checkpoint(saved)  # loaded, then a step without wrapping the model: an error, not silence
        lone = nn.Linear(3, 1)
        ctx.optimizers.append(torch.optim.SGD(lone.parameters(), lr=0.1))
        with pytest.raises(CheckpointError, match="not fully applied before the first optimizer step"):
            ctx.step_optimizer(ctx.optimizers[0])
    finally:
        ctx.close()


def test_loader_options_split_and_the_deprecated_shuffle(recwarn):
    from dtrain.engine import data as data_module

    ctx = dtrain.init(seed=0, quiet=True)
    try:
        data = TensorDataset(torch.arange(10))
        batches = list(ctx.loader(data, 4, split="train", drop_last=False, collate_fn=lambda rows: len(rows)))
        assert batches == [4, 4, 2]  # the tail kept as a smaller batch; collate_fn applied
        assert [len(b[0]) for b in ctx.loader(data, 4)] == [4, 4]  # default: full batches only
        evaluation = ctx.loader(data, 4, split="eval")
        assert sorted(int(i) for (b,) in evaluation for i in b) == list(range(10))
        assert evaluation.pin_memory is False  # CPU: nothing to pin for
        with pytest.raises(UserError, match="persistent_workers needs background loader processes"):
            ctx.loader(data, 4, persistent_workers=True)
        with pytest.raises(UserError, match="sets sampler itself"):
            ctx.loader(data, 4, sampler=None)
        with pytest.raises(UserError, match="split must be 'train' or 'eval'"):
            ctx.loader(data, 4, split="validation")
        data_module._warned_shuffle = False
        old = ctx.loader(data, 4, shuffle=False)
        ctx.loader(data, 4, False)  # old positional form
        assert isinstance(old.sampler, ShardSampler)
        warned = [w for w in recwarn if issubclass(w.category, FutureWarning)]
        assert len(warned) == 1 and "split='eval'" in str(warned[0].message)
    finally:
        ctx.close()


def test_init_says_what_it_seeds_and_rank_streams_differ(capsys):
    import numpy as np

    from dtrain.engine.seeding import rank_seed

    ctx = dtrain.init(seed=11)
    try:
        err = capsys.readouterr().err
        assert "seed 11: torch, numpy and random global RNGs seeded alike" in err and "rank_generator" in err
        assert np.random.rand() == np.random.RandomState(11).rand()
        draws = torch.rand(3, generator=ctx.rank_generator())
        assert torch.equal(draws, torch.rand(3, generator=ctx.rank_generator()))  # reproducible
        assert rank_seed(11, 0) != rank_seed(11, 1) != rank_seed(12, 1)
    finally:
        ctx.close()


class _Store:
    """The four calls of torch's Store that the roll call uses, in a dict (one process plays every rank)."""

    def __init__(self) -> None:
        self.data: dict[str, object] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, amount):
        self.data[key] = int(self.data.get(key, 0)) + amount
        return self.data[key]


def test_roll_call_judges_by_epochs_only_on_ranks_that_train():
    from dtrain.engine.rollcall import RollCall, SaveMismatchError

    store = _Store()
    worker, server, other = (RollCall(r, 3, timeout_seconds=0.3, store=store) for r in range(3))
    worker.epoch_started(0)
    other.epoch_started(1)  # a worker an epoch ahead: it passed the save
    with pytest.raises(SaveMismatchError, match=r"rank\(s\) 2 \(it started epoch 1\)"):
        worker.arrive()
    # A server iterates no data: the workers' epochs say nothing to it; it waits, then names who is missing.
    with pytest.raises(SaveMismatchError, match=r"rank\(s\) 2 did not call it within 0.3s"):
        server.arrive()
    other.close()
    with pytest.raises(SaveMismatchError, match=r"2 \(it closed its context\)"):
        server.arrive()
    assert RollCall(0, 1, 1.0).active is False  # a world of one has nobody to wait for
