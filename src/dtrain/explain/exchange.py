"""Which runs the cost model can price, by how their strategy's replicas talk (``profile.exchange``).

The cost model (:mod:`dtrain.explain.costmodel`) prices one exchange: DDP's, the gradients (or local SGD's
parameters) all-reduced among the slots in buckets over the measured link. Two built-in strategies talk
otherwise, and a prediction built on that model is wrong for them by a factor, not by a margin:

* ``server`` (``parameter_server``): workers push gradients to server ranks and pull parameters back. Its
  slots are its workers only, and its exchange is not an all-reduce: the model drops it from the step
  altogether, so no change of such a run is predicted.
* ``sharded`` (``fsdp``): all-gathers and reduce-scatters run inside forward and backward, where the run timed
  them as compute. What does not touch the exchange (the batch, the precision, the loader) is priced from the
  step as measured; a change of slots, hosts or synchronization is not: it would split a step the run could
  not split.

Where a change is not priced, the doctor, ``--try`` and ``dtrain plan`` say why in one line and point to
measuring it (``--verify``; ``dtrain compare`` for strategies), never to a number.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.explain.costmodel import Target
from dtrain.profiling.record import ProfileRecord

PRICED = "all_reduce"
MEASURE = "dtrain doctor RUN --try KEY=VALUE --verify measures a change"
WHY = {
    "server": ("its workers push gradients to server ranks and pull parameters back, which the cost model "
               "(DDP's all-reduce among the slots) does not price"),
    "sharded": ("its all-gathers and reduce-scatters run inside forward and backward and were timed as compute, "
                "so the run cannot tell its communication from its compute"),
}
# Changes that move the exchange itself: what a ``sharded`` run cannot price.
EXCHANGE_KEYS = ("resources.slots_per_trial", "nodes", "optimizations.aggregation_frequency",
                 "optimizations.gradient_compression", "optimizations.tensor_fusion_threshold")


@dataclass(frozen=True, slots=True)
class Unpriced:
    """Why some changes of a run are not priced: ``reason`` (one clause), and whether it is every change
    (``everything``) or only those that move the exchange."""

    reason: str
    everything: bool

    def covers(self, target: Target, here: Target) -> bool:
        """Whether ``target`` (a change of the run at ``here``) is one the model does not price."""
        return self.everything or moves_exchange(target, here)

    def covers_key(self, key: str) -> bool:
        """Whether a change of ``key`` (as ``--try`` spells it) is one the model does not price."""
        return self.everything or key in EXCHANGE_KEYS

    def message(self, what: str) -> str:
        """'cannot predict WHAT because ...; <how to measure it>'."""
        return f"cannot predict {what} because {self.reason}; {MEASURE}"


def kind(profile: ProfileRecord) -> str:
    """How the run's replicas talk: as recorded, else (a profile from before it was recorded) as the
    strategy's class says, else DDP's all-reduce."""
    if profile.exchange is not None:
        return profile.exchange
    from dtrain.sync import registry

    try:
        return registry.lookup(profile.strategy).exchange
    except KeyError:
        return PRICED


def unpriced(profile: ProfileRecord) -> Unpriced | None:
    """What the cost model cannot price for this run (None: every change it knows)."""
    found = kind(profile)
    if found == PRICED:
        return None
    why = WHY.get(found, f"it exchanges as {found!r}, which the cost model (DDP's all-reduce) does not price")
    return Unpriced(f"sync.strategy {profile.strategy} exchanges otherwise than DDP: {why}",
                    everything=found != "sharded")


def moves_exchange(target: Target, here: Target) -> bool:
    """Whether ``target`` changes the exchange of the run at ``here``: its slots, hosts, synchronization
    period, compression or buckets."""
    return ((target.slots, target.nodes) != (here.slots, here.nodes)
            or (target.aggregation or here.aggregation) != here.aggregation
            or (target.compression or here.compression) != here.compression
            or target.one_bucket or target.bucket_mb is not None)
