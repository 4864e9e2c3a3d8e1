"""The loader handoff probe (profiling/handoff.py): a batch timed through one loader process, without
touching the run's random stream, and skipped (not failed) where a loader process cannot take the data; the
doctor's loader plan prices it, so a batch cheaper to load in place than to hand over is predicted slower."""

from __future__ import annotations

import re

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from dtrain.profiling.handoff import handoff_figures, on_host


def test_a_batch_through_a_loader_process_is_timed_and_the_random_stream_is_left_alone():
    data = TensorDataset(torch.randn(100, 8), torch.randn(100, 1))
    state = torch.get_rng_state()
    figures = handoff_figures(DataLoader(data, batch_size=16), 16)
    assert torch.equal(torch.get_rng_state(), state)
    assert figures["probe_handoff"] > 0 and 0 <= figures["probe_handoff_cpu"] < 1


class Stream(IterableDataset):
    def __iter__(self):
        return iter([torch.zeros(2)] * 4)


def test_a_data_set_a_loader_process_cannot_take_is_skipped():
    assert handoff_figures(DataLoader(Stream(), batch_size=2), 2) == {}


def test_only_host_batches_go_to_a_loader_process():
    assert on_host((torch.zeros(1), {"y": [torch.zeros(1)]}, "label"))
    meta = torch.empty(1, device="meta")
    assert not on_host([torch.zeros(1), meta])


def test_the_loader_plan_prices_the_handoff_both_ways():
    from profiles import make_profile

    from dtrain.explain.advice import loader_plan

    seconds = {"data": 0.0002, "forward": 0.0003, "backward": 0.0003, "optimizer": 0.0002}
    base = make_profile([seconds], threads_per_slot=1, cpu_cores=2, data_loader_workers=0,
                        data_load_seconds_per_batch=0.0002, data_load_cpu_share=1.0)
    step, work = 0.001, 0.0008
    # Before the probe existed: the in-place load hidden by a loader process, never slower.
    assert loader_plan(base, 0.0002, step, work, workers=1).step_seconds <= step
    # A handoff of 1.4 ms a batch (digits' 64 records here) against 0.2 ms in place: slower, as measured.
    cheap = base.model_copy(update={"data_handoff_seconds_per_batch": 0.0014,
                                    "data_handoff_cpu_seconds_per_batch": 0.0005})
    plan = loader_plan(cheap, 0.0002, step, work, workers=1)
    assert plan.step_seconds > 1.3 * step and "through a loader process 1.40 ms a batch" in plan.why
    # Loading that waits (disk, network: little CPU) and costs far more in place than the handoff: faster.
    slow = cheap.model_copy(update={"data_load_seconds_per_batch": 0.02, "data_load_cpu_share": 0.05,
                                    "data_handoff_seconds_per_batch": 0.0201})
    slow_step = 0.0008 + 0.02
    assert loader_plan(slow, 0.02, slow_step, work, workers=4).step_seconds < slow_step / 3


def test_the_doctor_says_why_it_does_not_advise_loader_processes():
    """A run that waits for its batches, whose batches cost more to hand over than to load in place: the data
    factor keeps its share and says why nothing is to try, instead of advising a loader process."""
    from profiles import make_profile

    from dtrain.explain.doctor import diagnose, render

    seconds = {"data": 0.0004, "forward": 0.0003, "backward": 0.0003, "optimizer": 0.0002}
    profile = make_profile([seconds], threads_per_slot=1, cpu_cores=2, data_loader_workers=0,
                           data_load_seconds_per_batch=0.0003, data_load_cpu_share=1.0,
                           data_handoff_seconds_per_batch=0.0015, data_handoff_cpu_seconds_per_batch=0.0006)
    diagnosis = diagnose(profile)
    row = next(f for f in diagnosis.factors if f.factor == "data_loading")
    assert row.key is None and row.advice.declined and "not worth a change" in row.why
    assert all(r.key != "data_loader.num_workers" for r in diagnosis.recommendations)
    said = r"data_loading: .*through a loader process 1\.50 ms a batch.* no faster than today"
    assert re.search(said, render(diagnosis))


def test_a_run_whose_loader_processes_cost_more_than_loading_in_place_is_told_to_drop_them():
    """digits with num_workers: 1 on 2 slots (measured 2026-11-27: 16,258 samples/s; without loader processes
    1.98x that): the data factor offered only more processes. Now it offers none, with the in-place load."""
    from profiles import make_profile

    from dtrain.explain.doctor import diagnose

    seconds = {"data": 0.0013, "forward": 0.00036, "backward": 0.00037, "comm_exposed": 0.0016, "optimizer": 0.00023}
    profile = make_profile([seconds, seconds], threads_per_slot=1, cpu_cores=2, data_loader_workers=1,
                           data_load_seconds_per_batch=0.00008, data_load_cpu_share=1.0,
                           data_handoff_seconds_per_batch=0.00108, data_handoff_cpu_seconds_per_batch=0.00046)
    row = next(f for f in diagnose(profile).factors if f.factor == "data_loading")
    assert (row.key, row.value) == ("data_loader.num_workers", 0), row
    assert row.predicted_speedup > 1.3 and "with no loader process each slot loads its batch in place" in row.why
    # Without the handoff probe (an older profile) the in-place load is not known to be faster: not offered.
    older = profile.model_copy(update={"data_handoff_seconds_per_batch": None})
    row = next(f for f in diagnose(older).factors if f.factor == "data_loading")
    assert row.value != 0
