"""What a term of the cost model is (:class:`Term`), what it sees (:class:`At`: the model, the target, and the
target's shape computed once) and what it reports (:class:`TermValue`: its seconds at the run and at the target,
one standard deviation of them, and each input with where it came from).

A step is the sum of the registered terms (:func:`dtrain.explain.terms.registry.terms`). A new term is one module
with a registered :class:`Term` subclass; the cost model, ``--explain`` and ``--json`` find it there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from dtrain.explain.facts import Facts
from dtrain.explain.network import Link, RingLink
from dtrain.explain.target import Target

if TYPE_CHECKING:
    from dtrain.explain.precision import GainCurve

# Where an input came from: the run, a probe after it (or dtrain plan --probe), the user, or nobody.
MEASURED, PROBED, GIVEN, ASSUMED, FITTED = "measured", "probed", "given", "assumed", "fitted"


class Model(Protocol):
    """What a term reads of :class:`dtrain.explain.costmodel.CostModel` (which evaluates the terms: no import
    back)."""

    facts: Facts
    link: RingLink | None
    half_link: RingLink | None
    link_source: str
    link_residual: float
    between_hosts: Link | None
    overhead: float
    overhead_source: str
    factor: float
    contention: float
    exchange_scale: float
    held_exchange: float
    late: float
    shared_host: bool

    def local_threads(self, target: Target) -> tuple[int, int]: ...
    def contention_at(self, local: int) -> float: ...
    def buckets(self, nbytes: float, one_bucket: bool, bucket_mb: float | None = None) -> list[float]: ...
    def allreduce(self, nbytes: float, target: Target, tree: bool = True, half: bool = False) -> float: ...
    def sharded_collectives(self, target: Target) -> float: ...


@dataclass(frozen=True, slots=True)
class Input:
    """One input of a term: its name, its value in words, and where it came from."""

    name: str
    value: str
    source: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "value": self.value, "source": self.source}


@dataclass(frozen=True, slots=True)
class Shape:
    """The target as every term reads it: local slots and threads by the launcher's rule, the per-slot batch and
    its ratio to the run's, the slots that share one machine's memory, and threads over cores (1 unless the
    shared-host set is on and a CPU host is crowded: :mod:`dtrain.explain.terms.shared_host`)."""

    local: int
    threads: int
    batch: float
    ratio: float
    machine_slots: int
    crowd: float
    contention: float
    gain: float  # another precision's compute speed-up at this batch and thread count (1: none)

    @classmethod
    def of(cls, model: Model, target: Target) -> Shape:
        from dtrain.explain.terms import shared_host

        f = model.facts
        local, threads = model.local_threads(target)
        batch = (target.global_batch or f.global_batch) / target.slots
        machine = shared_host.machine_slots(model, target, local)
        curve: GainCurve | None = target.precision_curve
        gain = target.precision_gain if curve is None else curve.at(batch, threads)
        return cls(local, threads, batch, batch / f.per_slot_batch if f.per_slot_batch else 1.0, machine,
                   shared_host.crowd(model, target, local, threads), model.contention_at(machine), gain)


@dataclass
class At:
    """One evaluation: the model, the target, its shape, and the seconds of the terms evaluated before."""

    model: Model
    target: Target
    shape: Shape
    parts: dict[str, float] = field(default_factory=dict)
    detail: dict[str, float] = field(default_factory=dict)  # a term's sub-figures (the exchange's compression)

    @property
    def facts(self) -> Facts:
        return self.model.facts


class Term:
    """One named part of a step. Subclasses set ``name`` (the key of the prediction's parts), ``uncertain`` (the
    names of the interval's sources that are this term's: :mod:`dtrain.explain.spread`) and register with
    :func:`dtrain.explain.terms.registry.register`. Terms are evaluated in the registry's order, so a term may
    read an earlier one's seconds (the exchange reads compute's backward)."""

    name: ClassVar[str]
    uncertain: ClassVar[tuple[str, ...]] = ()

    def seconds(self, at: At) -> float:
        """Seconds per step of this term at ``at.target``."""
        raise NotImplementedError

    def inputs(self, at: At) -> list[Input]:
        """What the seconds rest on, each with where it came from."""
        return []


@dataclass(frozen=True, slots=True)
class TermValue:
    """A term evaluated at the run and at a target: seconds per step of each, one standard deviation of the
    target's (from the interval's sources that are the term's), and the inputs at the target."""

    name: str
    run_seconds: float
    target_seconds: float
    sd_seconds: float
    inputs: tuple[Input, ...]

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "run_seconds": self.run_seconds, "target_seconds": self.target_seconds,
                "sd_seconds": self.sd_seconds, "inputs": [i.to_json() for i in self.inputs]}


def sd_of(term: Term, sigmas: dict[str, float]) -> float:
    """One standard deviation of ``term``'s seconds: the root sum of squares of its sources in ``sigmas``."""
    return math.sqrt(sum(sigmas.get(name, 0.0) ** 2 for name in term.uncertain))


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3f} ms"
