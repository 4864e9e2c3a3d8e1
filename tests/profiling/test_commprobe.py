"""dtrain plan's local all-reduce probe: real processes give a link, a process that dies gets one more try."""

from __future__ import annotations

import pytest

from dtrain.profiling import commprobe


def test_two_local_processes_measure_a_link_and_a_training_exchange(tmp_path):
    probe = commprobe.probe_local(2, 1, 10_000, 64.0, steps=20, timeout=120, budget=0.3)
    # More steps than asked where they fit the budget: a synced step's time is skewed (a rank waits for its
    # peer's lost time slice), and the mean of many is steadier.
    assert 20 < probe.steps <= commprobe.MOST_STEPS and probe.steps % 20 == 0
    assert [b for b, _ in probe.points] == [float(b) for b in commprobe.SIZES]
    assert all(s > 0 for _, s in probe.points)
    # And fp16 all-reduces, for the 16-bit compressions (Gloo sums those at a rate of its own).
    assert [b for b, _ in probe.half_points] == [float(b) for b in commprobe.HALF_SIZES]
    assert all(s > 0 for _, s in probe.half_points)
    link = commprobe.fit(probe.points)
    assert link.rate > 0 and link.latency >= 0
    assert probe.compute_seconds > 0 and probe.exchange_seconds >= 0
    # The stand-in's own buckets at the run's cap: what its exchanges sent, which the overhead is beyond.
    assert probe.buckets == [40_400.0]  # one linear layer of 100 x 100 and its bias
    commprobe.save(probe, tmp_path / commprobe.PROBE_FILE)
    assert commprobe.load(tmp_path / commprobe.PROBE_FILE) == probe

def test_a_probe_process_that_dies_is_retried_once_then_named(monkeypatch):
    figures = {"points": [[4096, 1e-4], [2**20, 1e-3]], "compute_seconds": 1e-3, "exchange_seconds": 2e-4}
    attempts = []

    def dies_first(*args):
        attempts.append(args)
        if len(attempts) == 1:
            raise commprobe.ProbeDied("process 1 terminated with signal SIGABRT")
        return figures

    monkeypatch.setattr(commprobe, "_probe_once", dies_first)
    probe = commprobe.probe_local(2, 1, 100, 64.0)
    assert len(attempts) == 2 and probe.exchange_seconds == 2e-4

    def always_dies(*args):
        raise commprobe.ProbeDied("process 1 terminated with signal SIGABRT")

    monkeypatch.setattr(commprobe, "_probe_once", always_dies)
    with pytest.raises(commprobe.ProbeFailed, match=r"failed 2 times \(process 1 terminated .*SIGABRT;.*--link"):
        commprobe.probe_local(2, 1, 100, 64.0)


def test_a_probe_that_hangs_is_not_tried_again(monkeypatch):
    attempts = []

    def hangs(*args):
        attempts.append(args)
        raise commprobe.ProbeFailed("the local all-reduce probe of 2 processes took over 120 s")

    monkeypatch.setattr(commprobe, "_probe_once", hangs)
    with pytest.raises(commprobe.ProbeFailed, match="took over 120 s"):
        commprobe.probe_local(2, 1, 100, 64.0)
    assert len(attempts) == 1


def test_a_slow_spell_over_most_repeats_of_a_size_does_not_set_its_figure():
    """A size's figure is the lower quartile of its repeats: on a shared VM a spell of slow all-reduces (a peer off
    its core) spanned most of a size's repeats, and the median read 0.3 ms in one probe and 3.8 ms in the next."""
    fast, slow = [0.0003 + i * 1e-6 for i in range(4)], [0.0035] * 7
    assert commprobe.lower_quartile(slow + fast) == pytest.approx(0.000302)  # the third fastest of 11
    assert commprobe.lower_quartile([5.0, 1.0, 4.0, 2.0, 3.0]) == 2.0  # of 5 (the fp16 sizes): the second
