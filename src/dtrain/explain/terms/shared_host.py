"""The optional set of effects only a crowded, shared host shows (the 2-core machine dtrain's held-out rows
were measured on; a GPU host, or a CPU host with a core per thread, never sees them):

* **crowd**: more threads than a host's cores take turns on them, and every term that runs on the CPU slows by
  threads over cores (a load's waiting share excepted: :mod:`.data`);
* **a peer off its core**: with more processes than cores, each ring step waits, on average, half a scheduler
  slice for the (local - cores) / local of its peers the scheduler put aside;
* **one machine's memory**: hosts that are network namespaces of one machine (``Target.machine_slots``:
  scripts/testhosts.py) contend for its memory bandwidth as local slots do;
* **a token-bucket shaper**: a shaped link releases at most one bucket per timer wake-up (:mod:`..network`).

``CostModel.shared_host`` False leaves the whole set out: the model of a host that has a core per thread and
a network that is not shaped by a timer.
"""

from __future__ import annotations

import math
from typing import Protocol

from dtrain.explain import fitted
from dtrain.explain.facts import Facts
from dtrain.explain.target import Target


class Model(Protocol):
    """What this set reads of the cost model (:class:`dtrain.explain.terms.base.Model`: no import back)."""

    facts: Facts
    shared_host: bool


def crowd(model: Model, target: Target, local: int, threads: int) -> float:
    """Threads over cores at ``target`` where beyond one (a CPU host only); 1 with the set off."""
    cores = target.cores or model.facts.cores
    return max(1.0, local * threads / cores) if model.facts.device == "cpu" and model.shared_host else 1.0


def run_crowd(model: Model) -> float:
    """Threads over cores of the run itself (:attr:`Facts.crowd`); 1 with the set off."""
    return model.facts.crowd if model.shared_host else 1.0


def machine_slots(model: Model, target: Target, local: int) -> int:
    """Slots that share one machine's memory at ``target``: its local slots, or the test hosts' machine's."""
    return (target.machine_slots or local) if model.shared_host else local


def descheduled(model: Model, target: Target) -> float:
    """Seconds one collective waits for peers off their cores: a ring step needs its peer running, and with more
    processes than a host's cores, (local - cores) / local of them wait half a scheduler slice on average, at
    each of the 2(n-1) steps (beyond the cores' shared time, which the crowd prices)."""
    n = target.slots
    local = max(1, math.ceil(n / target.nodes))
    cores = target.cores or model.facts.cores
    if model.facts.device != "cpu" or local <= cores or not model.shared_host:
        return 0.0
    return 2 * (n - 1) * (local - cores) / local * fitted.load().terms["scheduler_slice_seconds"] / 2


def shaper_tick(model: Model) -> float:
    """A token-bucket shaper's timer wake-up (fitted); 0 with the set off (a link paced by its rate alone)."""
    return fitted.load().terms["shaper_tick_seconds"] if model.shared_host else 0.0
