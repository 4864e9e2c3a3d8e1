"""Stragglers named: how late each rank arrives at the gradient collectives, without synchronized clocks.

A collective finishes on every rank at about the same moment (when the last rank's data is in), so the
rank that arrives last waits least. Per sampled step, with ``w_i`` rank i's exposed communication wait
(``comm_exposed``: the tail of ``backward()``, or the exchange inside ``step_optimizer`` for strategies
that exchange there)::

    lag_i = max_j(w_j) - w_i

is how much later than the earliest rank rank i arrived. Host clocks are never compared, only each
rank's own durations, so this holds across machines whose clocks disagree.

Sampling (:class:`LagSampler`) costs a few float additions into a preallocated buffer per sampled
step, done where the timer resolves its steps (on CUDA once per window: no extra synchronization). Every
timed exchanging step (the timer's own sample: :mod:`dtrain.profiling.timer`) is sampled until the buffer
is full; then every other sample is dropped and the stride doubles, so a run of any length keeps between
half and all of ``capacity`` evenly spaced samples. Every rank samples the same steps (ranks run the same
schedule, and the timer draws the same ones), so sample k of every rank is the same step.

At the end of the run the buffers travel in the one all_gather of the per-rank figures
(:func:`dtrain.profiling.figures.gather_rank_stats`), and :func:`rank_figures` turns them into per-rank
floats: median and p90 lag, how often the rank was last, and its excess over the fastest rank per phase.
:func:`section` makes ``profile.json``'s ``stragglers`` from them: a rank is *chronic* when it arrives last
in at least :data:`CHRONIC_LAST_FRACTION` of samples and its median lag is above a floor; two ranks taking
turns (noise) never are.
"""

from __future__ import annotations

from typing import Any

from dtrain.profiling.phases import PHASES
from dtrain.profiling.record import RankLag, Stragglers, WorkSeconds

SAMPLE_FIELDS = (*PHASES, "step")
WIDTH = len(SAMPLE_FIELDS)
STEP_COLUMN = WIDTH - 1
EXPOSED_COLUMN = PHASES.index("comm_exposed")
# The phases a rank can be slow *in* (its own work); comm_exposed is the waiting itself.
WORK_PHASES = tuple(p for p in PHASES if p != "comm_exposed")
CAPACITY = 256
# Chronic: last this often, and a median lag above the floor (an absolute floor for timer noise, and a
# share of the step below which a lag is not worth a person's time).
CHRONIC_LAST_FRACTION = 0.6
LAG_FLOOR_SECONDS = 2e-4
LAG_FLOOR_SHARE = 0.05
# Per-rank floats these figures add to the gathered per-rank stats.
RANK_KEYS = ("lag_samples", "lag_median", "lag_p90", "lag_mean", "last_fraction",
             *(f"excess_{p}" for p in WORK_PHASES))


class LagSampler:
    """Per-phase seconds of sampled exchanging steps, in a flat preallocated list (no per-step allocation)."""

    __slots__ = ("buffer", "capacity", "count", "seen", "stride")

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self.buffer = [0.0] * (capacity * WIDTH)
        self.count = 0  # samples held
        self.seen = 0  # exchanging profiled steps offered
        self.stride = 1

    def slot(self) -> int:
        """Offer the next exchanging step: the buffer offset to add its phases at, or -1 (not sampled)."""
        self.seen += 1
        if (self.seen - 1) % self.stride:
            return -1
        if self.count == self.capacity:
            self._halve()
            if (self.seen - 1) % self.stride:
                return -1
        base = self.count * WIDTH
        self.count += 1
        return base

    def _halve(self) -> None:
        """Keep samples 0, 2, 4, ... (the steps on the doubled stride), in place."""
        buf = self.buffer
        kept = (self.count + 1) // 2
        for j in range(1, kept):
            buf[j * WIDTH:(j + 1) * WIDTH] = buf[2 * j * WIDTH:(2 * j + 1) * WIDTH]
        buf[kept * WIDTH:] = [0.0] * ((self.capacity - kept) * WIDTH)
        self.count = kept
        self.stride *= 2

    def export(self) -> list[float]:
        """Fixed length (every rank's the same size, for one all_gather): count, then the buffer."""
        return [float(self.count), *self.buffer]

    @staticmethod
    def export_size(capacity: int = CAPACITY) -> int:
        return 1 + capacity * WIDTH


def _rows(flat: list[float]) -> list[list[float]]:
    count = int(flat[0])
    return [flat[1 + k * WIDTH:1 + (k + 1) * WIDTH] for k in range(count)]


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def rank_figures(exported: list[list[float]]) -> list[dict[str, float]]:
    """Every rank's lag figures (seconds, fractions) from every rank's exported sampler."""
    per_rank = [_rows(flat) for flat in exported]
    ranks = len(per_rank)
    samples = min((len(r) for r in per_rank), default=0)
    lags: list[list[float]] = [[] for _ in range(ranks)]
    last = [0] * ranks
    excess = [dict.fromkeys(WORK_PHASES, 0.0) for _ in range(ranks)]
    used = 0
    for k in range(samples):
        rows = [per_rank[i][k] for i in range(ranks)]
        waits = [row[EXPOSED_COLUMN] for row in rows]
        latest = max(waits)
        used += 1
        for i in range(ranks):
            lags[i].append(latest - waits[i])
        last[min(range(ranks), key=lambda i: waits[i])] += 1
        for phase in WORK_PHASES:
            column = PHASES.index(phase)
            fastest = min(row[column] for row in rows)
            for i in range(ranks):
                excess[i][phase] += rows[i][column] - fastest
    out = []
    for i in range(ranks):
        figures = {"lag_samples": float(used), "lag_median": _quantile(lags[i], 0.5),
                   "lag_p90": _quantile(lags[i], 0.9), "lag_mean": sum(lags[i]) / used if used else 0.0,
                   "last_fraction": last[i] / used if used else 0.0}
        figures.update({f"excess_{p}": excess[i][p] / used if used else 0.0 for p in WORK_PHASES})
        out.append(figures)
    return out


def slow_phase(figures: dict[str, Any]) -> tuple[str, float]:
    """The work phase in which a rank is furthest behind the fastest rank, and by how much (seconds)."""
    phase = max(WORK_PHASES, key=lambda p: float(figures.get(f"excess_{p}", 0.0)))
    return phase, float(figures.get(f"excess_{phase}", 0.0))


def section(per_rank: list[dict[str, float]], hosts: list[str], step_seconds: float) -> Stragglers:
    """``profile.json``'s ``stragglers``: per rank lag and slow phase, and the chronic rank if any."""
    floor = max(LAG_FLOOR_SECONDS, LAG_FLOOR_SHARE * step_seconds)
    ranks = []
    for i, r in enumerate(per_rank):
        phase, behind = slow_phase(r)
        chronic = r["last_fraction"] >= CHRONIC_LAST_FRACTION and r["lag_median"] > floor
        ranks.append(RankLag(rank=i, host=hosts[i] if i < len(hosts) else "",
                             lag_median_seconds=r["lag_median"], lag_p90_seconds=r["lag_p90"],
                             lag_mean_seconds=r["lag_mean"], last_fraction=r["last_fraction"],
                             slow_phase=phase, slow_phase_excess_seconds=behind,
                             excess_seconds=WorkSeconds(**{p: r[f"excess_{p}"] for p in WORK_PHASES}),
                             chronic=chronic))
    chronic_ranks = [r for r in ranks if r.chronic]
    worst = max(chronic_ranks, key=lambda r: r.lag_median_seconds) if chronic_ranks else None
    return Stragglers(samples=int(per_rank[0]["lag_samples"]) if per_rank else 0, lag_floor_seconds=floor,
                      chronic_last_fraction=CHRONIC_LAST_FRACTION, chronic_rank=worst.rank if worst else None,
                      per_rank=ranks)
