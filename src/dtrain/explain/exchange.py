"""Which changes of a run the cost model can price, by how its strategy's replicas talk (``profile.exchange``).

The cost model (:mod:`dtrain.explain.costmodel`) prices one exchange from a link: DDP's, the gradients (or
local SGD's parameters) all-reduced among the slots in buckets. Two built-in strategies talk otherwise, and
a change of that exchange priced as an all-reduce is wrong by a factor, not by a margin:

* ``server`` (``parameter_server``): workers push gradients to server ranks, the servers step, workers pull
  the weights back. Its slots are its workers only. The model holds that exchange as the run measured it, per
  update: what leaves it alone (the batch, the precision, the loader) and how often it runs (aggregation) are
  priced; other slots, hosts, compression or buckets are not (a server's link is not a ring).
* ``sharded`` (``fsdp``): all-gathers and reduce-scatters run inside forward and backward, where the run timed
  them as compute. What does not touch the exchange (the batch, the precision, the loader) is priced from the
  step as measured. Its end-of-run probe, where the gathered model fit, takes the collectives out of forward
  and backward at the run's own slot count (:mod:`dtrain.explain.sharded`: the communication row, and DDP on
  the same slots) and counts them: then other slots and hosts are priced too, the collectives held as
  measured and scaled by the ring on the link the ranks measured; aggregation, compression and buckets not.

Where a change is not priced, the doctor, ``--try`` and ``dtrain plan`` say why in one line and point to
measuring it (``--verify``; ``dtrain compare`` for strategies), never to a number.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.explain.costmodel import Target
from dtrain.explain.facts import exchange_kind as kind
from dtrain.profiling.record import ALL_REDUCE, SERVER, SHARDED, ProfileRecord

PRICED = ALL_REDUCE
MEASURE = "dtrain doctor RUN --try KEY=VALUE --verify measures a change"
WHY = {
    SERVER: ("its workers push gradients to server ranks and pull parameters back: the cost model holds that "
               "exchange as the run measured it, and prices DDP's all-reduce among the slots only"),
    SHARDED: ("its all-gathers and reduce-scatters run inside forward and backward and were timed as compute, "
                "so the run cannot tell its communication from its compute"),
}
SLOTS, NODES = "resources.slots_per_trial", "nodes"
AGGREGATION = "optimizations.aggregation_frequency"
COMPRESSION, FUSION = "optimizations.gradient_compression", "optimizations.tensor_fusion_threshold"
# Changes that move the exchange itself: what a ``sharded`` run cannot price.
EXCHANGE_KEYS = (SLOTS, NODES, AGGREGATION, COMPRESSION, FUSION)
# A ``server`` run's exchange, held as measured, still runs once per update: how often is priced.
UNPRICED_KEYS: dict[str, tuple[str, ...]] = {SHARDED: EXCHANGE_KEYS, SERVER: (SLOTS, NODES, COMPRESSION, FUSION)}
ASIDES = {SHARDED: " (the communication row reads 0: it is inside forward and backward)"}
# How the doctor names a set of unpriced keys.
NAMES = {SLOTS: "slots", NODES: "hosts", AGGREGATION: "aggregation", COMPRESSION: "compression", FUSION: "fusion"}


@dataclass(frozen=True, slots=True)
class Unpriced:
    """Why some changes of a run are not priced: ``reason`` (one clause), and the changes, as ``--try`` keys
    (:data:`EXCHANGE_KEYS`), that it covers (None: every change)."""

    reason: str
    keys: tuple[str, ...] | None
    aside: str = ""  # what the doctor's table shows of it, where that reads oddly
    alone: str = ""  # why one slot is not priced either (from a run of several), where it is not

    def reason_for(self, target: Target, here: Target) -> str | None:
        """Why ``target`` (a change of the run at ``here``) is not priced; None: it is."""
        if self.alone and target.slots == 1 < here.slots:
            return self.alone
        return self.reason if self.keys is None or moves_exchange(target, here, self.keys) else None

    def covers_key(self, key: str) -> bool:
        """Whether a change of ``key`` (as ``--try`` spells it) is one the model does not price."""
        return self.keys is None or key in self.keys

    @property
    def changes(self) -> str:
        """'any change of this run', or 'a change of slots, hosts, compression or fusion'."""
        if self.keys is None:
            return "any change of this run"
        names = [NAMES[key] for key in self.keys]
        return "a change of " + (", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0])

    def message(self, what: str, reason: str | None = None) -> str:
        """'cannot predict WHAT because ...; <how to measure it>' (``reason``: another than the run's own)."""
        return f"cannot predict {what} because {reason or self.reason}; {MEASURE}"


# A sharded run whose end-of-run probe took its collectives out of forward and backward (dtrain.explain.sharded).
SPLIT = ("its all-gathers and reduce-scatters (one of each per unit and step, and a second all-gather) were "
         "measured at the end of the run at its own slot count only: how they grow with slots and hosts is not "
         "modelled")


# What stays unpriced of a sharded run whose collectives were counted.
SHARDED_KEPT = ("FSDP all-gathers each unit's parameters and reduce-scatters its gradients every step, inside "
                "forward and backward: aggregation (gradients then held unsharded), compression and DDP's buckets "
                "do not apply as they do to DDP's all-reduce")

SHARDED_ALONE = ("on one slot dtrain trains the model unsharded, without FSDP's hooks and its optimizer's step on "
                 "DTensor shards, which this run's compute and optimizer include and did not measure apart (on a "
                 "CPU they can be most of a small model's step)")


# A run with profiling.probes off: what would price a change was not measured.
NOT_PROBED = ("the run turned its end-of-run probes off (profiling.probes: false): they time what a change moves "
              "(the model's step at other batch sizes, threads and precisions, the loader, the all-reduce at other "
              "sizes); run with profiling.probes: true, the default, to price it")
# A script's run (dtrain launch SCRIPT): dtrain does not own its step, so nothing was probed at its end.
SCRIPT_NOT_PROBED = ("the run is a script's (dtrain does not own its step, so no end-of-run probe timed what a "
                     "change moves): measure it with --verify")


def unpriced(profile: ProfileRecord) -> Unpriced | None:
    """What the cost model cannot price for this run (None: every change it knows)."""
    if not profile.probes:
        return Unpriced(NOT_PROBED if profile.script is None else SCRIPT_NOT_PROBED, None)
    found = kind(profile)
    if found == PRICED:
        return None
    why = WHY.get(found, f"it exchanges as {found!r}, which the cost model (DDP's all-reduce) does not price")
    aside = ASIDES.get(found, "")
    if found == SHARDED and profile.sharded_exchange is not None:
        why, aside = SPLIT, ""
        if (profile.sharded_exchange.collectives and profile.comm_probe is not None
                and (profile.aggregation_frequency or 1) == 1):
            # Counted, and a link measured among the ranks: FSDP's collectives are priced at other slots and
            # hosts by the ring (dtrain.explain.costmodel: held, scaled); not how often or how they are sent.
            return Unpriced(f"sync.strategy {profile.strategy} exchanges otherwise than DDP: {SHARDED_KEPT}",
                            (AGGREGATION, COMPRESSION, FUSION), alone=SHARDED_ALONE)
    return Unpriced(f"sync.strategy {profile.strategy} exchanges otherwise than DDP: {why}",
                    UNPRICED_KEYS.get(found), aside)


def moves_exchange(target: Target, here: Target, keys: tuple[str, ...] = EXCHANGE_KEYS) -> bool:
    """Whether ``target`` changes what ``keys`` name of the exchange of the run at ``here``: its slots, hosts,
    synchronization period, compression or buckets."""
    moved = {SLOTS: target.slots != here.slots, NODES: target.nodes != here.nodes,
             AGGREGATION: (target.aggregation or here.aggregation) != here.aggregation,
             COMPRESSION: (target.compression or here.compression) != here.compression,
             FUSION: target.one_bucket or target.bucket_mb is not None}
    return any(moved[key] for key in keys)
