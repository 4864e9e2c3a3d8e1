"""How the cost model prices one all-reduce: the links, the ring and NCCL's tree, a shaper's pacing.

An all-reduce of ``n`` ranks moves ``2(n-1)/n`` of its bytes through every link of a ring in ``2(n-1)`` steps,
each paying the link's per-message latency. NCCL's tuner (``src/graph/tuning.cc``, ``ncclTopoTuneModel``)
also prices a double binary tree across nodes: latency ``2((n/nodes - 1) x intra + log2(nodes) x inter)``
and 0.92 of the ring's bus bandwidth; it runs whichever is faster, so large node counts get the tree.
Gloo (CPU) always runs the ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtrain.profiling.commprobe import LinkFit

# NCCL's tuning model: a tree all-reduce gets this share of the ring's bus bandwidth.
TREE_BANDWIDTH = 0.92


@dataclass(frozen=True, slots=True)
class Link:
    """Between hosts: bytes per second and seconds of latency per ring step (None: as measured).

    ``burst_bytes``: where the rate is a token-bucket shaper's (``tc ... tbf burst``), its bucket: a message
    leaves one bucket per refill, and never faster than one bucket per timer wake-up of the shaper."""

    bytes_per_second: float | None
    latency_seconds: float
    label: str
    burst_bytes: float | None = None


def expected_max(n: int) -> float:
    """Expected maximum of ``n`` standard normal draws (the slowest of ``n`` ranks, in standard deviations)."""
    exact = {1: 0.0, 2: 0.5642, 3: 0.8463, 4: 1.0294, 5: 1.1630, 6: 1.2672, 7: 1.3522, 8: 1.4236}
    if n in exact:
        return exact[n]
    root = math.sqrt(2 * math.log(n))
    return root - (math.log(math.log(n)) + math.log(4 * math.pi)) / (2 * root)


def ring(n: int) -> float:
    """Share of an all-reduce's bytes that cross each link of a ring of ``n``."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def tree_latency_steps(n: int, nodes: int) -> tuple[int, int]:
    """(steps within a node, steps between nodes) of NCCL's tree all-reduce."""
    local = max(1, n // max(1, nodes))
    return 2 * (local - 1), 2 * math.ceil(math.log2(nodes)) if nodes > 1 else 0


def shaped_seconds(nbytes: float, link: Link, tick: float) -> float:
    """Seconds for one message of ``nbytes`` through ``link``'s rate: a shaper (``burst_bytes``) lets the
    first bucket through at once and each further one after a refill or a timer wake-up, whichever is later."""
    rate = link.bytes_per_second
    if rate is None:
        return 0.0
    if link.burst_bytes is None or nbytes <= link.burst_bytes:
        return nbytes / rate
    return max(nbytes / rate, (math.ceil(nbytes / link.burst_bytes) - 1) * max(link.burst_bytes / rate, tick))


@dataclass(frozen=True, slots=True)
class RingLink:
    """A link as a ring all-reduce sees it: seconds per ring step and bytes per second through each link."""

    step_latency: float
    busbw: float

    @classmethod
    def from_fit(cls, link: LinkFit, world: int) -> RingLink:
        """From an all-reduce fit on ``world`` ranks: its latency spread over the ring's ``2(world-1)`` steps."""
        return cls(link.latency / (2 * (world - 1)), link.rate * ring(world))

    def allreduce(self, nbytes: float, world: int) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` among ``world`` ranks on this link alone."""
        if world < 2:
            return 0.0
        return 2 * (world - 1) * self.step_latency + ring(world) * nbytes / self.busbw
