"""The end-of-run probes' guards, in-process: what they leave alone rather than risk the end of a run."""

from types import SimpleNamespace

import torch
from torch import nn

from dtrain.profiling import probes, shardprobe
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
    result = probes.batch_probe(_facts(SHARDED), repeats=3)  # type: ignore[arg-type]
    assert set(result.figures.values()) == {0.0} and result.model_steps is None


def test_on_a_cpu_the_free_memory_is_shared_by_the_hosts_ranks(monkeypatch):
    model = nn.Linear(1000, 1000)
    optimizers = [torch.optim.SGD(model.parameters())]
    need = shardprobe._replica_bytes([model], optimizers)  # parameters, gradients, DDP's buckets of them
    assert need == 3 * 4 * (1000 * 1000 + 1000)
    monkeypatch.setattr(shardprobe, "_free_bytes", lambda device: 2 * 3 * need)  # half of it: 3 replicas
    cpu = torch.device("cpu")
    assert shardprobe.fits_unsharded([model], optimizers, cpu, None, 3)
    assert not shardprobe.fits_unsharded([model], optimizers, cpu, None, 4)
