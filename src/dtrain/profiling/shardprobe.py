"""What a sharded (FSDP) run's collectives cost a step, measured at the end of the run.

FSDP all-gathers each unit's parameters before its forward and again before its backward, and
reduce-scatters its gradients, inside forward and backward: the run timed them as compute, and its
communication row reads 0. So on every rank at once, the trial's ``train_batch`` (forward and backward)
runs in alternating rounds as the run ran it (*sharded*) and *local*: every unit's parameters gathered once,
untimed, and held (FSDP's public switches ``set_reshard_after_forward``, ``set_reshard_after_backward``,
``set_requires_gradient_sync``), no gradient reduced. The least time of each counts, as in the other
probes; their difference is what the collectives cost a step beside the same work, and the local rounds are
the step's compute as a replica per slot (DDP) would run it.

The local rounds hold the whole model and its gradients on every rank: where DDP's own footprint (the
parameters, their gradients, DDP's buckets of them and the optimizer's whole state) would not fit in half the
memory free for each of the host's ranks (a model sharded because it is too big), every rank skips the probe;
the ranks agree first, and after every round (one rank failing alone, out of memory, would otherwise go on to
the run's next collective while the others wait in the probe's). The probe's passing is what the doctor's
advice of DDP rests on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from dtrain import dist as ddist
from dtrain.profiling.clock import synchronized_now
from dtrain.profiling.probeguard import available_host_bytes

FIELDS = ("probe_sharded_step", "probe_sharded_local", "probe_sharded_collectives", "probe_sharded_bytes")
# Share of the free memory the gathered parameters and their gradients may take.
MEMORY_SHARE = 0.5

log = logging.getLogger(__name__)


def _fsdp_modules(models: Sequence[nn.Module]) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for model in models for m in model.modules() if isinstance(m, FSDPModule)]


def _free_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    return available_host_bytes()


def _replica_bytes(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> float:
    """What one slot of DDP holds of the models: parameters, gradients, DDP's buckets of them and the optimizers'
    whole state (a DTensor counts its global size: every shard)."""
    params = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
    state = sum(t.numel() * t.element_size() for opt in optimizers for per_param in opt.state.values()
                for t in per_param.values() if isinstance(t, torch.Tensor))
    return 3 * params + state


def fits_unsharded(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], device: torch.device,
                   group: ProcessGroup | None, local_ranks: int) -> bool:
    """Whether DDP's footprint of the models (:func:`_replica_bytes`) fits in :data:`MEMORY_SHARE` of the memory
    free for each of the host's ``local_ranks`` ranks, on every rank (a collective: every rank calls it). A
    probe that holds a sharded model's parameters or gradients unsharded runs only where it does: one rank out
    of memory alone would leave the others waiting in the probe's next collective."""
    try:  # this rank's part, before the agreement: a rank that cannot tell says no, and every rank skips
        fits = fits_here(models, optimizers, device, local_ranks)
    except Exception as exc:
        log.info("sharded probe: memory not known: %s", exc)
        fits = False
    return _agreed(fits, group)


def fits_here(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], device: torch.device,
              local_ranks: int) -> bool:
    """:func:`fits_unsharded` on this rank alone (no collective)."""
    free = MEMORY_SHARE * _free_bytes(device) / (max(1, local_ranks) if device.type == "cpu" else 1)
    return _replica_bytes(models, optimizers) <= free


def _agreed(ok: bool, group: ProcessGroup | None) -> bool:
    """Whether ``ok`` holds on every rank (a collective)."""
    return ddist.least_over_ranks(int(ok), group) == 1


def _local(modules: list[nn.Module], roots: set[int], local: bool) -> None:
    """Hold every unit's parameters gathered with no gradient reduced, or put FSDP's own settings back (the
    root keeps its gathered parameters after forward: FSDP's default for it)."""
    for m in modules:
        m.set_requires_gradient_sync(not local, recurse=False)  # type: ignore[operator]
        m.set_reshard_after_backward(not local, recurse=False)  # type: ignore[operator]
        m.set_reshard_after_forward(not local and id(m) not in roots, recurse=False)  # type: ignore[operator]
    if local:
        for m in modules:
            m.unshard()  # type: ignore[operator]
    else:
        for m in modules:
            m.reshard()  # type: ignore[operator]


def _clear_grads(models: Sequence[nn.Module]) -> None:
    for model in models:
        for p in model.parameters():  # while gathered: the gathered parameters' own gradients
            p.grad = None


@dataclass(frozen=True)
class Units:
    """This rank's part of the probe before its collectives (:func:`sharded_units`): the FSDP units, the roots'
    ids, the models, and whether DDP's footprint fits here."""

    modules: list[nn.Module]
    roots: set[int]
    models: tuple[nn.Module, ...]
    fits: bool


def sharded_units(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], device: torch.device,
                  local_ranks: int) -> Units:
    """The probe's rank-local preparation (no collective): the FSDP units and whether DDP's footprint would fit
    beside the host's ``local_ranks`` ranks (:func:`fits_here`)."""
    modules = _fsdp_modules(models)
    return Units(modules, {id(m) for m in models if m in modules}, tuple(models),
                 bool(modules) and fits_here(models, optimizers, device, local_ranks))


def sharded_exchange(units: Units, train: Callable[[], object], device: torch.device, group: ProcessGroup | None,
                     repeats: int) -> dict[str, float]:
    """``probe_sharded_step`` and ``probe_sharded_local`` (least seconds of forward and backward with FSDP's
    collectives, and with the parameters held gathered); empty where the models are not sharded, DDP's
    footprint would not fit on some rank (:func:`sharded_units`), or a round failed on some rank. Collective:
    every rank calls it with the same ``repeats``. Gradients are cleared; FSDP's settings and sharded
    parameters are put back."""
    modules, roots, models = units.modules, units.roots, units.models
    if not modules or not ddist.is_distributed(group) or not _agreed(units.fits, group):
        return {}
    least = {True: float("inf"), False: float("inf")}
    for round_ in range(repeats + 1):  # the first round warms both up
        seconds = _round(modules, roots, models, train, device)
        if not _agreed(seconds is not None, group):
            return {}
        if round_ and seconds is not None:
            least = {local: min(least[local], seconds[local]) for local in least}
    count, nbytes = collectives(modules, roots)
    return {"probe_sharded_step": least[False], "probe_sharded_local": least[True],
            "probe_sharded_collectives": float(count), "probe_sharded_bytes": float(nbytes)}


def collectives(modules: list[nn.Module], roots: set[int]) -> tuple[int, int]:
    """FSDP's collectives in one training step and the bytes they gather or scatter in all: each unit with
    parameters of its own all-gathers them before forward, again before backward unless it is a root (which
    keeps them gathered after forward), and reduce-scatters their gradients (as large as the parameters)."""
    units = {id(m) for m in modules}
    count = nbytes = 0
    for m in modules:
        nested = {id(p) for child in m.modules() if child is not m and id(child) in units for p in child.parameters()}
        own = sum(p.numel() * p.element_size() for p in m.parameters() if id(p) not in nested)
        if own == 0:
            continue
        gathers = 1 if id(m) in roots else 2
        count += gathers + 1
        nbytes += (gathers + 1) * own
    return count, nbytes


def _round(modules: list[nn.Module], roots: set[int], models: Sequence[nn.Module], train: Callable[[], object],
           device: torch.device) -> dict[bool, float] | None:
    """One sharded and one local forward and backward, seconds by ``local``; None where either failed (its
    exception logged; FSDP's settings and per-step state put back)."""
    seconds: dict[bool, float] = {}
    held = False
    try:
        for local in (False, True):
            if local:
                held = True  # before: a gather that fails partway still has its settings put back
                _local(modules, roots, True)
            seconds[local] = _timed(train, device)
            _clear_grads(models)
            if local:
                _local(modules, roots, False)
                held = False
        return seconds
    except Exception as exc:  # out of memory on this rank alone: the others are told at the next agreement
        log.info("sharded exchange probe stopped: %s", exc)
        for m in modules:
            if id(m) in roots:
                m.reset_iter_state()  # type: ignore[operator]  # FSDP's own reset after an aborted step
        return None
    finally:
        _clear_grads(models)
        if held:
            _local(modules, roots, False)


def _timed(train: Callable[[], object], device: torch.device) -> float:
    start = synchronized_now(device)
    train()
    return synchronized_now(device) - start
