"""Straggler figures: the sampler's bounded, aligned buffer and the lag arithmetic, on scripted numbers."""

import pytest

from dtrain.profiling import stragglers
from dtrain.profiling.phases import PHASES
from dtrain.profiling.stragglers import WIDTH, LagSampler, rank_figures, section


def _fill(sampler, steps, value_of):
    """Offer ``steps`` exchanging steps; a sampled one gets ``value_of(step)`` in its data column."""
    for step in range(1, steps + 1):
        base = sampler.slot()
        if base >= 0:
            sampler.buffer[base] += value_of(step)


def test_sampler_keeps_evenly_spaced_steps_in_a_fixed_buffer():
    sampler = LagSampler(capacity=8)
    _fill(sampler, 100, float)
    kept = [sampler.buffer[k * WIDTH] for k in range(sampler.count)]
    # Stride doubled until the offered steps fit: steps 1, 1+s, 1+2s, ... whatever the run's length.
    assert sampler.stride == 16 and kept == [1.0, 17.0, 33.0, 49.0, 65.0, 81.0, 97.0]
    assert len(sampler.buffer) == 8 * WIDTH and len(sampler.export()) == LagSampler.export_size(8)
    short = LagSampler(capacity=8)
    _fill(short, 5, float)
    assert short.stride == 1 and [short.buffer[k * WIDTH] for k in range(5)] == [1.0, 2.0, 3.0, 4.0, 5.0]


def _export(rows):
    sampler = LagSampler(capacity=len(rows))
    for row in rows:
        base = sampler.slot()
        sampler.buffer[base:base + WIDTH] = row
    return sampler.export()


def _row(**phases):
    values = [phases.get(p, 0.0) for p in PHASES]
    return [*values, sum(values)]


def test_the_rank_that_waits_least_arrived_last_and_its_slow_phase_is_named():
    # Rank 1 spends 8 ms more in forward; rank 0 waits those 8 ms at the all-reduce.
    rank0 = [_row(forward=0.001, comm_exposed=0.0085 + 1e-4 * k) for k in range(10)]
    rank1 = [_row(forward=0.009, comm_exposed=0.0005) for _ in range(10)]
    figures = rank_figures([_export(rank0), _export(rank1)])
    assert figures[1]["last_fraction"] == 1.0 and figures[0]["last_fraction"] == 0.0
    assert figures[1]["lag_median"] == pytest.approx(0.0080 + 4.5e-4)
    assert figures[0]["lag_median"] == 0.0
    assert stragglers.slow_phase(figures[1]) == ("forward", pytest.approx(0.008))
    doc = section(figures, ["a", "b"], step_seconds=0.010)
    assert doc.chronic_rank == 1 and doc.per_rank[1].host == "b" and doc.samples == 10


def test_ranks_taking_turns_are_noise_not_a_chronic_straggler():
    rank0 = [_row(forward=0.001, comm_exposed=0.002 if k % 2 else 0.0) for k in range(10)]
    rank1 = [_row(forward=0.001, comm_exposed=0.0 if k % 2 else 0.002) for k in range(10)]
    doc = section(rank_figures([_export(rank0), _export(rank1)]), ["a", "a"], step_seconds=0.004)
    assert doc.chronic_rank is None
    assert [r.last_fraction for r in doc.per_rank] == [0.5, 0.5]
