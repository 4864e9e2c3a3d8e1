"""The end-of-run probes' guards, in-process: what they leave alone rather than risk the end of a run."""

from types import SimpleNamespace

import torch
from helpers import run_ranks
from torch import nn

from dtrain.profiling import probeguard, probes, shardprobe
from dtrain.profiling.probeguard import ProbeGuard
from dtrain.profiling.record import SHARDED


class _Untouchable:
    """Hooks of a trial that must not be called: any attribute read fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the probe used the trial's {name}")


def _facts(exchange):
    model = nn.Linear(4, 2)
    timer = SimpleNamespace(last_step_seconds=0.01, exchanging=False)
    return SimpleNamespace(probe=_Untouchable(), models=(model,), optimizers=(torch.optim.SGD(model.parameters()),),
                           per_slot_batch_size=8, timer=timer, device=torch.device("cpu"), unobserved_phases=(),
                           strategy=SimpleNamespace(exchange=exchange, dp_group=None, dp_rank=0), local_ranks=2)


def test_a_sharded_model_whose_whole_gradients_would_not_fit_is_not_probed(monkeypatch):
    # The work probe keeps a sharded model's gradients whole on every rank (no reduce-scatter): a model sharded
    # because it does not fit whole would run out of memory on some rank, and the others would wait for it.
    monkeypatch.setattr(shardprobe, "_free_bytes", lambda device: 1.0)
    guard = ProbeGuard(None, 10.0)
    result = probes.batch_probe(_facts(SHARDED), guard, repeats=3)  # type: ignore[arg-type]
    assert set(result.figures.values()) == {0.0} and result.model_steps is None
    assert [(s.probe, s.reason) for s in guard.skipped] == [
        ("batch_probe", "the sharded model's whole gradients would not fit beside it")]


def test_on_a_cpu_the_free_memory_is_shared_by_the_hosts_ranks(monkeypatch):
    model = nn.Linear(1000, 1000)
    optimizers = [torch.optim.SGD(model.parameters())]
    need = shardprobe._replica_bytes([model], optimizers)  # parameters, gradients, DDP's buckets of them
    assert need == 3 * 4 * (1000 * 1000 + 1000)
    monkeypatch.setattr(shardprobe, "_free_bytes", lambda device: 2 * 3 * need)  # half of it: 3 replicas
    cpu = torch.device("cpu")
    assert shardprobe.fits_unsharded([model], optimizers, cpu, None, 3)
    assert not shardprobe.fits_unsharded([model], optimizers, cpu, None, 4)



def test_saved_state_over_its_host_budget_skips_the_probe_before_any_copy(monkeypatch):
    # restored() keeps a host copy of every model's and optimizer's state on every rank: a model too big for its
    # share of the host's memory (shared by the host's ranks) is not probed, and the trial's step is never called.
    facts = _facts("all_reduce")  # local_ranks: 2
    need = probeguard.saved_state_bytes(facts.models, facts.optimizers)
    assert need == 4 * (4 * 2 + 2)  # the weights and the bias (SGD without momentum keeps no state)
    monkeypatch.setattr(probeguard, "available_host_bytes", lambda: 1.9 * need / probeguard.HOST_STATE_SHARE)
    guard = ProbeGuard(None, 10.0)
    assert set(probes.batch_probe(facts, guard, repeats=3).figures.values()) == {0.0}  # type: ignore[arg-type]
    assert [s.probe for s in guard.skipped] == ["batch_probe"] and "saved state" in guard.skipped[0].reason
    # Where it fits the probe goes on to the trial's hooks (which fail here, a failure the guard records).
    monkeypatch.setattr(probeguard, "available_host_bytes", lambda: 2.1 * need / probeguard.HOST_STATE_SHARE)
    guard = ProbeGuard(None, 10.0)
    probes.batch_probe(facts, guard, repeats=3)  # type: ignore[arg-type]
    assert guard.skipped[0].probe == "batch_probe" and "the probe used the trial's" in guard.skipped[0].reason


def test_twice_the_batch_on_a_gpu_needs_twice_what_the_runs_batch_added_with_a_margin():
    gib = 2.0**30
    # The run peaked 10 GiB above the 20 GiB it holds between steps: twice the batch needs 2 x 10 x margin.
    need = 2 * 10 * probeguard.DOUBLE_BATCH_MARGIN * gib
    assert probeguard.double_batch_refusal(30 * gib, 20 * gib, need - 1 * gib, 1 * gib) is None  # cached blocks count
    refusal = probeguard.double_batch_refusal(30 * gib, 20 * gib, need - 2 * gib, 1 * gib)
    assert refusal is not None and "twice the batch needs about 25.00 GiB" in refusal
    assert probeguard.double_batch_room(torch.device("cpu")) is None  # off a GPU: not checked


def test_the_time_budget_is_a_share_of_the_training_with_a_floor():
    assert probeguard.time_budget(0.0) == probeguard.MIN_SECONDS
    assert probeguard.time_budget(10 * probeguard.MIN_SECONDS / probeguard.TIME_SHARE) == 10 * probeguard.MIN_SECONDS


def test_a_spent_budget_stops_every_later_probe_without_running_it():
    now = [0.0]
    guard = ProbeGuard(None, 5.0, clock=lambda: now[0])
    guard.start()
    assert guard.run("first", lambda: "ran", None) == "ran"  # within the budget
    assert guard.run("long", lambda: "ran", None, needs=6.0) is None  # would not fit in what is left
    now[0] = 5.5  # a probe overran: spent at the next agreement
    assert guard.run("overran", lambda: "ran", None) == "ran"
    assert guard.left == 0.0
    called = []
    assert guard.run("after", lambda: called.append(1), "default") == "default" and not called
    assert [s.probe for s in guard.skipped] == ["long", "after"]
    assert "time budget (5.0 s) was spent" in guard.skipped[1].reason


def test_a_failure_is_caught_and_named_and_its_result_dropped():
    guard = ProbeGuard(None, 5.0)
    guard.start()

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert guard.run("batch_scaling", oom, "default") == "default"
    prepared = []
    assert guard.run_collective("comm_probe", lambda: prepared.append(1), lambda _: 1 / 0, "default") == "default"
    assert prepared == [1]
    assert [(s.probe, s.reason) for s in guard.skipped] == [
        ("batch_scaling", "rank 0: out of memory"), ("comm_probe", "rank 0: ZeroDivisionError: division by zero")]


def _agreeing_ranks(rank, world, fail_on):
    """Two ranks, each a stage that fails on ``fail_on`` alone: both skip it, and both go on to the next. Then
    ``fail_on`` alone is asked to stop (Ctrl-C): the stage running then ends, and both skip every later one."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    asked = []
    # each rank its own budget: the least counts
    guard = ProbeGuard(dist.group.WORLD, 5.0 + rank, stop_requested=lambda: bool(asked))
    guard.start()

    def stage():
        if rank == fail_on:
            raise RuntimeError("only here")
        return rank

    first = guard.run("stage", stage, None)
    prepared = guard.run_collective("collective", lambda: rank,
                                    lambda r: dist.all_reduce(t := torch.tensor([r])) or int(t), None)
    if rank == fail_on:
        asked.append("SIGINT")
    running = guard.run("running", lambda: rank, None)
    later = guard.run_collective("later", lambda: rank, lambda r: dist.all_reduce(torch.tensor([r])), None)
    dist.destroy_process_group()
    return first, prepared, (running, later), [(s.probe, s.reason) for s in guard.skipped], guard.left <= 5.0


def test_every_rank_agrees_on_a_probe_one_rank_failed_and_on_a_stop_one_rank_was_asked_for():
    results = run_ranks(_agreeing_ranks, 2, timeout=60, args=(1,))
    for rank, (first, prepared, (running, later), skipped, least_budget) in enumerate(results):
        assert first is None and prepared == 1 and least_budget
        assert running == rank and later is None  # never entered: no rank waits in its collective
        assert skipped == [("stage", "rank 1: RuntimeError: only here"),
                           ("later", "the run was asked to stop (Ctrl-C or SIGTERM) after it had trained")]
