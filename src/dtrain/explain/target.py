"""A configuration the cost model (:mod:`dtrain.explain.costmodel`) prices (the run's own, or a change of it), and
its price."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.explain.precision import GainCurve


@dataclass(frozen=True, slots=True)
class Target:
    """A configuration to price. None fields: as the measured run had it."""

    slots: int
    nodes: int = 1
    global_batch: int | None = None
    threads: int | None = None  # per slot; None: the launcher's rule (cores // local slots, at least 1)
    aggregation: int | None = None
    compression: str | None = None
    one_bucket: bool = False
    bucket_mb: float | None = None  # optimizations.tensor_fusion_threshold; None: the run's buckets as measured
    precision_gain: float = 1.0
    precision_spread: float = 0.0  # one relative sd of precision_gain, as its timed steps spread (measured)
    # precision_gain at other per-slot batches and thread counts (None: precision_gain at any)
    precision_curve: GainCurve | None = None
    data_workers_step: float | None = None  # the data wait with other loader processes (the doctor's plan)
    data_workers_timed: bool = False  # that wait's step timed after the run beside the training's work
    precision_data: float | None = None  # the least data wait in another precision (a host-bound GPU step)
    cores: int | None = None  # per host; None: as many as the run's host had
    # Slots sharing one machine's caches and memory bandwidth; None: a host's local slots. Hosts that are network
    # namespaces of one machine (scripts/testhosts.py) share it: their slots slow each other as local ones do.
    machine_slots: int | None = None
    late_gone: bool = False  # the chronically late rank left the run (one slot fewer without it): no one waits


@dataclass(frozen=True, slots=True)
class Prediction:
    """Seconds per step by part, the step, and its 80% interval; samples/s the same way."""

    target: Target
    parts: dict[str, float]
    step: float
    low: float
    high: float
    global_batch: int
    widest: str = ""  # the input whose uncertainty widens the interval most

    @property
    def samples_per_second(self) -> float:
        return self.global_batch / self.step

    @property
    def samples_per_second_low(self) -> float:
        return self.global_batch / self.high

    @property
    def samples_per_second_high(self) -> float:
        return self.global_batch / self.low
