"""The loader handoff probe (profiling/handoff.py): a batch timed through one loader process, without
touching the run's random stream, and skipped (not failed) where a loader process cannot take the data; the
doctor's loader plan prices it, so a batch cheaper to load in place than to hand over is predicted slower. On a
CPU host the step with 1, 2, ... loader processes is also timed beside the training's work (the crowded probe),
and the plan takes those steps as they were timed."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from dtrain.profiling import handoff
from dtrain.profiling.handoff import crowded_steps, handoff_figures, on_host


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


class Sleepy(Dataset):
    """Records that wait (as a file or a network would), 1 ms each, and use little CPU."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.001)
        return torch.zeros(4)


@pytest.mark.timeout(60)
def test_the_crowded_probe_times_a_step_per_loader_count_within_its_budget():
    # 8 records of 1 ms a batch through a loader process, a 2 ms rest of the step: 5 processes would hide it.
    start = time.perf_counter()
    steps = crowded_steps(DataLoader(Sleepy(), batch_size=8), 8, rest=0.002, through=0.0095)
    spent = time.perf_counter() - start
    assert list(steps) == list(range(1, len(steps) + 1)) and len(steps) >= 2, steps
    # Each step at least the rest of the step, and more loader processes make it shorter (one loads at ~9 ms).
    assert all(s >= 0.002 for s in steps.values()) and steps[1] > 0.008 and steps[2] < steps[1], steps
    # The budget holds it to about a second (each count's processes start beside it).
    assert spent < handoff.CROWDED_BUDGET_SECONDS + 2.0, spent
    # Nothing to hide (the load is faster than the rest of the step): one count, as for any load.
    assert list(crowded_steps(DataLoader(Sleepy(), batch_size=1), 1, rest=0.01, through=0.001)) == [1]


def test_a_step_too_long_for_the_budget_is_not_probed_and_a_failing_loader_reports_nothing():
    # A 1 s rest of the step: 10 steps would take 10 s, not a small cost beside a run.
    assert crowded_steps(DataLoader(Sleepy(), batch_size=8), 8, rest=1.0, through=2.0) == {}
    assert crowded_steps(DataLoader(Stream(), batch_size=2), 2, rest=0.001, through=0.002) == {}


def test_the_loader_plan_takes_the_crowded_steps_as_timed():
    """The planted slow-data case on the 2-core VM (2 slots, 1 ms per record): the formula put 3 loader
    processes at a 7.0 ms step, the runs took 10-11 ms; the crowded probe had timed 8.4-12.2 ms."""
    from profiles import make_profile

    from dtrain.explain.advice import loader_plan

    seconds = {"data": 0.0187, "forward": 0.001, "backward": 0.0006, "comm_exposed": 0.0021, "optimizer": 0.0004}
    profile = make_profile([seconds, seconds], threads_per_slot=1, cpu_cores=2, data_loader_workers=0,
                           data_load_seconds_per_batch=0.0179, data_load_cpu_share=0.06,
                           data_handoff_seconds_per_batch=0.0197, data_handoff_cpu_seconds_per_batch=0.0018)
    step, work = 0.0228, 0.002
    formula = {w: loader_plan(profile, 0.0187, step, work, workers=w) for w in (2, 3, 4)}
    assert not any(plan.timed for plan in formula.values())
    timed = profile.model_copy(update={"data_crowded_step_seconds": [0.0204, 0.0112, 0.0101]})
    plans = {w: loader_plan(timed, 0.0187, step, work, workers=w) for w in (1, 2, 3, 4)}
    assert [plans[w].step_seconds for w in (1, 2, 3)] == [0.0204, 0.0112, 0.0101]
    assert all(plans[w].timed for w in (1, 2, 3)) and not plans[4].timed
    assert "a step with 3 loader process(es) per slot timed 10.10 ms" in plans[3].why
    # Beyond the counts timed: the formula, as crowded as the most timed was against it.
    crowding = 0.0101 / formula[3].step_seconds
    assert plans[4].step_seconds == pytest.approx(formula[4].step_seconds * crowding)
    assert "as crowded as with 3" in plans[4].why
    # The doctor's advice, fewest processes within 3% of the best, from the timed steps.
    assert loader_plan(timed, 0.0187, step, work).workers == 3


def test_a_timed_loader_count_is_predicted_with_a_measured_interval():
    from profiles import make_profile

    from dtrain.explain.doctor import diagnose

    seconds = {"data": 0.0187, "forward": 0.001, "backward": 0.0006, "comm_exposed": 0.0021, "optimizer": 0.0004}
    profile = make_profile([seconds, seconds], threads_per_slot=1, cpu_cores=2, data_loader_workers=0,
                           data_load_seconds_per_batch=0.0179, data_load_cpu_share=0.06,
                           data_handoff_seconds_per_batch=0.0197, data_handoff_cpu_seconds_per_batch=0.0018,
                           data_crowded_step_seconds=[0.0204, 0.0112, 0.0101])
    row = next(f for f in diagnose(profile).factors if f.factor == "data_loading")
    assert (row.key, row.value) == ("data_loader.num_workers", 3), row
    # The step is the one timed (10.1 ms against the run's 22.8 ms), and the interval is a measured input's.
    assert row.predicted_speedup == pytest.approx(0.0228 / 0.0101, rel=0.02)
    low, high = row.predicted_interval
    assert high / low < 1.7, row.predicted_interval


@pytest.mark.slow
@pytest.mark.parametrize("slots", [1, 2])
def test_a_real_run_records_its_crowded_steps(reference_runs, slots):
    from dtrain.profiling.record import load_profile

    record = load_profile(reference_runs.run_dir(slots) / "profile.json")
    steps = record.data_crowded_step_seconds
    # Every rank timed the same counts (a collective), from one loader process up; each step at least the
    # rest of the run's step, whose CPU time it repeats.
    assert steps and len(steps) <= handoff.MAX_WORKERS, steps
    rest = record.seconds_per_step.step.mean - record.seconds_per_step.data.mean
    assert all(s >= 0.9 * rest for s in steps), (steps, rest)
