"""The loader handoff probe (profiling/handoff.py): a batch timed through one loader process, without
touching the run's random stream, and skipped (not failed) where a loader process cannot take the data; the
doctor's loader plan prices it, so a batch cheaper to load in place than to hand over is predicted slower. On a
CPU host the step with 1, 2, ... loader processes is also timed beside the training's work (the crowded probe),
and the plan takes those steps as they were timed."""

from __future__ import annotations

import multiprocessing
import re
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from dtrain.profiling import handoff
from dtrain.profiling.handoff import Pace, crowded_steps, handoff_figures, on_host


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


def _working(seconds: float, taken: list[object | None]):
    """A training step that keeps this thread busy ``seconds``, and notes each batch it was given."""
    def step(batch: object | None) -> None:
        taken.append(batch)
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
    return step


@pytest.mark.timeout(60)
def test_the_crowded_probe_times_a_step_per_loader_count_within_its_budget():
    # 8 records of 1 ms a batch through a loader process, a 2 ms rest of the step: 5 processes would hide it.
    taken: list[object | None] = []
    children = set(multiprocessing.active_children())
    start = time.perf_counter()
    timed = crowded_steps(DataLoader(Sleepy(), batch_size=8), 8, Pace(rest=0.002, load=0.0095, through=0.0095),
                          0, group=None, step=_working(0.002, taken))
    spent = time.perf_counter() - start
    assert timed is not None
    steps = timed.steps
    # The most processes first (5 hide the load), down as far as the budget goes (to one on an idle host, to three
    # under the suite's load).
    assert list(steps) == list(range(5, 5 - len(steps), -1)) and len(steps) >= 2, steps
    # Each step at least the rest of the step; the run's own (each batch loaded in place, after the rest of the
    # step) about their sum, and longer than with the loads hidden.
    assert all(s >= 0.002 for s in steps.values()), steps
    assert 0.0105 < timed.own < 0.03 and timed.own > min(steps.values()), timed
    # Every step was given a real batch of the run's per-slot size; the epochs (8 batches) ran on and on.
    assert taken and all(isinstance(b, torch.Tensor) and b.shape == (8, 4) for b in taken)
    # The budget holds it to about two seconds (each count's processes start beside it), and none is left.
    assert spent < handoff.CROWDED_BUDGET_SECONDS + 2.0, spent
    assert set(multiprocessing.active_children()) <= children
    # Nothing to hide (the load is faster than the rest of the step): one count, as for any load.
    one = crowded_steps(DataLoader(Sleepy(), batch_size=1), 1, Pace(rest=0.01, load=0.001, through=0.001), 0,
                        group=None, step=_working(0.01, []))
    assert one is not None and list(one.steps) == [1]
    # A run with a loader process already: its own count is the reference, and among the steps; and none (0:
    # each batch loaded in place, here after a 10 ms rest: about as long).
    own = crowded_steps(DataLoader(Sleepy(), batch_size=1, num_workers=1, persistent_workers=True), 1,
                        Pace(rest=0.01, load=0.001, through=0.001), 1, group=None, step=_working(0.01, []))
    assert own is not None and set(own.steps) == {1, 0} and own.steps[1] == own.own, own
    assert 0.01 <= own.steps[0] < 0.03, own


def test_a_step_too_long_for_the_budget_is_not_probed_and_a_failing_loader_reports_nothing():
    # A 1 s rest of the step: 10 steps would take 10 s, not a small cost beside a run.
    taken: list[object | None] = []
    assert crowded_steps(DataLoader(Sleepy(), batch_size=8), 8, Pace(rest=1.0, load=2.0, through=2.0), 0,
                         group=None, step=_working(1.0, taken)) is None and not taken
    # A loader that cannot take the data: the steps still run (a peer's exchange would wait for them).
    assert crowded_steps(DataLoader(Stream(), batch_size=2), 2, Pace(rest=0.001, load=0.001, through=0.002), 0,
                         group=None, step=_working(0.001, taken)) is None
    assert taken and all(b is None for b in taken)


def test_the_loader_plan_takes_the_crowded_steps_as_timed():
    """The planted slow-data case on the 2-core VM (2 slots, 1 ms per record): the formula put 3 loader
    processes at a 7.0 ms step, the runs took 9.5-11 ms; the crowded probe timed 10.0 ms."""
    from profiles import make_profile

    from dtrain.explain.advice import loader_plan

    seconds = {"data": 0.0187, "forward": 0.001, "backward": 0.0006, "comm_exposed": 0.0021, "optimizer": 0.0004}
    profile = make_profile([seconds, seconds], threads_per_slot=1, cpu_cores=2, data_loader_workers=0,
                           data_load_seconds_per_batch=0.0179, data_load_cpu_share=0.06,
                           data_handoff_seconds_per_batch=0.0192, data_handoff_cpu_seconds_per_batch=0.0018)
    step, work = 0.0228, 0.002
    formula = {w: loader_plan(profile, 0.0187, step, work, workers=w) for w in (1, 2, 3, 4)}
    assert not any(plan.timed for plan in formula.values())
    timed = profile.model_copy(update={"data_crowded_step_seconds": [0.0204, 0.0124, 0.0100]})
    plans = {w: loader_plan(timed, 0.0187, step, work, workers=w) for w in (1, 2, 3, 4)}
    assert [plans[w].step_seconds for w in (1, 2, 3)] == [0.0204, 0.0124, 0.0100]
    assert all(plans[w].timed for w in (1, 2, 3)) and not plans[4].timed
    assert "a step with 3 loader process(es) per slot timed 10.00 ms" in plans[3].why
    # Beyond the counts timed: the formula, crowded on as the last two timed counts grew its crowding.
    crowding = {w: timed.data_crowded_step_seconds[w - 1] / formula[w].step_seconds for w in (2, 3)}
    expected = formula[4].step_seconds * (crowding[3] + (crowding[3] - crowding[2]))
    assert plans[4].step_seconds == pytest.approx(expected)
    assert "crowded on as the counts timed crowded them" in plans[4].why
    # The doctor's advice, fewest processes within 3% of the best, from the timed steps.
    assert loader_plan(timed, 0.0187, step, work).workers == 3
    # The probe timed the run's own step (loaded in place) at 20.0 ms, where the run's was 22.8 ms: each timed
    # step is taken as its ratio to that one, in the run's step.
    scaled = timed.model_copy(update={"data_crowded_own_step_seconds": 0.0200})
    plan = loader_plan(scaled, 0.0187, step, work, workers=3)
    assert plan.step_seconds == pytest.approx(0.0100 * step / 0.0200) and plan.timed
    assert "timed 10.00 ms beside the training's own work against 20.00 ms with the run's 0, so 11.40 ms" in plan.why
    # The probe had time for the most processes only (0: not timed): fewer crowd less, none at none.
    top = profile.model_copy(update={"data_crowded_step_seconds": [0.0, 0.0, 0.0100]})
    plans = {w: loader_plan(top, 0.0187, step, work, workers=w) for w in (1, 2, 3)}
    assert plans[3].step_seconds == 0.0100 and plans[3].timed and not plans[2].timed
    crowding = 0.0100 / formula[3].step_seconds
    for w in (1, 2):
        assert plans[w].step_seconds == pytest.approx(formula[w].step_seconds * (1 + (crowding - 1) * w / 3))


def test_dropping_the_loader_processes_is_priced_as_timed():
    """digits, 2 slots, 2 loader processes each on 2 cores: the step without them was priced at the rest of the
    step plus an in-place load, 1.42x (0.62-3.26), where 2.11x was measured: the loaders had taken the cores from
    the training's own phases too. The probe now times that step as well."""
    from profiles import make_profile

    from dtrain.explain.advice import loader_plan

    seconds = {"data": 0.0012, "forward": 0.0002, "backward": 0.0003, "comm_exposed": 0.0017, "optimizer": 0.0002}
    profile = make_profile([seconds, seconds], threads_per_slot=1, cpu_cores=2, data_loader_workers=2,
                           data_load_seconds_per_batch=0.00008, data_load_cpu_share=1.0,
                           data_handoff_seconds_per_batch=0.0009, data_handoff_cpu_seconds_per_batch=0.0004,
                           data_crowded_step_seconds=[0.0033, 0.0033], data_crowded_own_step_seconds=0.0033)
    step, work = 0.0036, 0.0024
    untimed = loader_plan(profile, 0.0012, step, work, workers=0)
    assert untimed.step_seconds == pytest.approx(step - 0.0012 + 0.00008) and not untimed.timed
    timed = profile.model_copy(update={"data_crowded_none_step_seconds": 0.0016})
    plan = loader_plan(timed, 0.0012, step, work, workers=0)
    assert plan.step_seconds == pytest.approx(0.0016 * step / 0.0033) and plan.timed, plan
    assert loader_plan(timed, 0.0012, step, work).workers == 0  # the doctor's advice: drop them


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
    # Every rank timed the same counts (a collective), the most loader processes first, as far down as the budget
    # went (0: a count not timed; fewer under the suite's load); each step about the rest of the run's step,
    # whose CPU time it repeats, at least (under the suite's load the run's moment was busier than the probe's:
    # 5.2 ms against a 6.1 ms rest once).
    assert steps and len(steps) <= handoff.MAX_WORKERS and steps[-1] > 0, steps
    timed = [s for s in steps if s > 0]
    assert timed == steps[len(steps) - len(timed):], steps  # no gap above the fewest timed
    rest = record.seconds_per_step.step.mean - record.seconds_per_step.data.mean
    assert all(s >= 0.5 * rest for s in timed), (steps, rest)
    # The run's own setting (each batch loaded in place) was timed too, the scale of the others: the same work
    # as the run's steps, at another moment (the probe's ran 10-20% faster on the idle 2-core VM; under the
    # suite's load, 2.0x faster once on a 1-slot run of 2.2 ms steps): within a factor 5.
    own, step = record.data_crowded_own_step_seconds, record.seconds_per_step.step.mean
    assert own is not None and step / 5 < own < 5 * step, (own, step)


def test_the_loading_figures_are_the_slowest_loading_ranks():
    """A synchronous step waits for the rank slowest to load its batch: its figures, not the mean over ranks
    (which gave a loading straggler half its load, and the fast rank's CPU share)."""
    from dtrain.profiling.figures import _probe_figures

    fast = {"probe_load": 0.0003, "probe_load_double": 0.0006, "probe_load_cpu_share": 1.0, "probe_handoff": 0.001,
            "probe_handoff_cpu": 0.0005}
    slow = {"probe_load": 0.041, "probe_load_double": 0.082, "probe_load_cpu_share": 0.02, "probe_handoff": 0.042,
            "probe_handoff_cpu": 0.0018}
    for ranks in ([fast, slow], [slow, fast]):
        out = _probe_figures(ranks, 4)
        assert (out["data_load_seconds_per_batch"], out["data_load_cpu_share"], out["data_handoff_seconds_per_batch"],
                out["data_handoff_cpu_seconds_per_batch"]) == (0.041, 0.02, 0.042, 0.0018), out


def test_a_slow_loaders_budget_goes_to_the_most_processes_first():
    """2 ms a record, 16 records a batch, a 3.3 ms rest of the step (a planted slow loader on the 2-core VM): equal
    shares of the budget left no count timed (its own steps, loaded in place, took 38 ms each), and the doctor
    advised 7 loader processes a slot at 7.3x by the formula alone; measured 4.5x. Each count now gets what its
    fewest steps take, the most processes first, where the formula misses most."""
    from dtrain.profiling.handoff import Feeding, _shares

    pace = Pace(rest=0.0033, load=0.034, through=0.035)
    shares = _shares(pace, Feeding(True, 2, 22), 0, list(range(pace.needed(), 0, -1)))
    kept = [w for w in shares if w]
    assert kept == list(range(8, 8 - len(kept), -1)) and len(kept) >= 4, shares
    assert 2 * shares[0] + sum(shares[w] for w in kept) <= handoff.CROWDED_BUDGET_SECONDS + 1e-9
    for w in (0, *kept):  # each count's share holds its fewest steps after its queued batches
        assert int(shares[w] / pace.step(w)) - Feeding(True, 2, 22).warmup(w) >= handoff.MIN_CROWDED_STEPS


class _NeverInALoaderProcess(Dataset):
    """Records that load in place but never arrive from a loader process (a hung process)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is not None:
            time.sleep(3600)
        return torch.zeros(2), torch.zeros(1)


def test_a_loader_process_that_never_delivers_ends_the_probe_within_its_timeout(monkeypatch):
    """Both loader probes give up on their own loader processes, well inside the collective timeout the run's
    peers wait in, and leave the run's own loader processes alone."""
    monkeypatch.setattr(handoff, "TIMEOUT_SECONDS", 0.5)
    runs_own = DataLoader(Sleepy(), batch_size=1, num_workers=1, persistent_workers=True)
    next(iter(runs_own))
    children = set(multiprocessing.active_children())
    started = time.monotonic()
    assert handoff_figures(DataLoader(_NeverInALoaderProcess(), batch_size=8), 8) == {}
    timed = crowded_steps(DataLoader(_NeverInALoaderProcess(), batch_size=8), 8,
                          Pace(rest=0.002, load=0.001, through=0.002), 0, group=None, step=_working(0.002, []))
    assert timed is not None and timed.steps == {}  # the run's own (loaded in place) timed; no count of processes
    # Killed, not asked to stop: torch's iterator waits 5 s for each loader process that does not answer.
    assert time.monotonic() - started < 6, time.monotonic() - started
    assert set(multiprocessing.active_children()) == children
    assert next(iter(runs_own)) is not None  # the run's own loader process still serves


def test_a_probes_loader_leaves_no_thread_behind_for_the_next_loader_to_fork_beside():
    """Its queues' feeder threads end after the loader, on their own; one ending while the next loader forks can
    leave that loader's process stuck for good (CPython 3.11's after-fork clean-up, seen in the suite)."""
    data = TensorDataset(torch.randn(100, 8), torch.randn(100, 1))
    before = set(threading.enumerate())
    for _ in range(5):  # without the wait, about one probe in three left a thread ending
        assert handoff_figures(DataLoader(data, batch_size=16), 16)
        assert set(threading.enumerate()) <= before, [t.name for t in threading.enumerate() if t not in before]
