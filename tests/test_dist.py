"""Which backend and device a rank gets, from a given GPU count and ``CUDA_VISIBLE_DEVICES`` (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from dtrain import dist as ddist
from dtrain.errors import UserError


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine shows ``n`` CUDA devices."""

    def visible(n: int, cuda_visible: str | None = None) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        if cuda_visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cuda_visible)

    return visible


def _env(local_rank: int, local_world: int) -> ddist.DistEnv:
    return ddist.DistEnv(rank=local_rank, world_size=local_world, local_rank=local_rank,
                         local_world_size=local_world)


def test_every_gpu_visible_to_every_rank(gpus):
    gpus(4)
    assert ddist.resolve_backend("auto", 4) == "nccl"
    assert [ddist.device_for("nccl", _env(r, 4)) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]


SLURM_TASK = {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "1", "SLURM_LOCALID": "2",
              "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_JOB_ID": "7"}


def test_one_gpu_bound_to_each_task(gpus, monkeypatch):
    # srun --ntasks-per-node=4 --gpus-per-task=1: every task sees one device, its own, as cuda:0.
    gpus(1, "3")
    assert not ddist.bound_per_task(4, 1)  # outside such a task: workers of one launcher share their view
    for key, value in SLURM_TASK.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ddist.bound_per_task(4, 1)
    assert ddist.resolve_backend("auto", 4, warn=False) == "nccl"  # was Gloo on CPU, silently
    assert ddist.device_for("nccl", _env(2, 4)) == torch.device("cuda", 0)  # was cuda:2, an invalid ordinal


def test_too_few_gpus_shared_by_the_ranks(gpus):
    gpus(1)  # one GPU that every rank sees: not a per-task binding
    assert not ddist.bound_per_task(2, 1)
    assert ddist.resolve_backend("auto", 2, warn=False) == "gloo"
    with pytest.raises(UserError, match="local rank 1 needs a GPU of its own but 1 are visible"):
        ddist.device_for("nccl", _env(1, 2))
    gpus(2, "0,1")
    assert ddist.gpus_for(4) == 2 and ddist.resolve_backend("auto", 4, warn=False) == "gloo"


def test_no_gpu_means_cpu(gpus):
    gpus(0)
    assert ddist.resolve_backend("auto", 2) == "gloo" and ddist.device_for("gloo", _env(1, 2)).type == "cpu"
    with pytest.raises(UserError, match="needs CUDA GPUs"):
        ddist.resolve_backend("nccl", 1)


def test_the_device_is_set_even_when_the_group_exists(gpus, monkeypatch):
    gpus(2)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # made by the user's own code
    ddist.init_process_group(_env(1, 2), "nccl", 10)
    assert chosen == [torch.device("cuda", 1)]
