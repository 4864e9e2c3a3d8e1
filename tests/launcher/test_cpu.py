"""One thread rule for run, bench and the doctor: free cores shared by the slots; the user's
OMP_NUM_THREADS respected by run (with a warning when it oversubscribes) and overridden by bench."""

import pytest

from dtrain.launcher import cpu


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(cpu, "cores", lambda: 2)
    monkeypatch.setattr(cpu, "USER_THREADS", None)


def test_free_cores_are_shared_and_busy_cores_are_not_counted(two_cores, monkeypatch):
    monkeypatch.setattr(cpu, "free_cores", lambda: 2.0)
    assert cpu.rule(1) == (2, None) and cpu.rule(2) == (1, None)
    monkeypatch.setattr(cpu, "free_cores", lambda: 0.2)
    threads, why = cpu.rule(1)
    assert threads == 1 and "1.8 of 2 cores busy" in why
    assert cpu.rule(2) == (1, None)  # one thread per slot is the floor, and no fewer than the even share


def test_user_setting_is_respected_by_run_and_overridden_by_bench(two_cores, monkeypatch):
    monkeypatch.setattr(cpu, "free_cores", lambda: 2.0)
    monkeypatch.setattr(cpu, "USER_THREADS", "2")
    assert cpu.for_run(1) == (2, None)
    threads, warning = cpu.for_run(2)
    assert threads == 2 and "oversubscribe" in warning
    monkeypatch.setattr(cpu, "USER_THREADS", "1")
    assert cpu.for_run(4) == (1, None)  # more slots than cores: dtrain would not choose fewer threads either
    monkeypatch.setattr(cpu, "USER_THREADS", "2")
    threads, reason = cpu.for_bench(2)
    assert threads == 1 and "OMP_NUM_THREADS=2 overridden" in reason
    assert cpu.for_bench(1) == (2, None)  # the user's value is the rule's: nothing to override


def test_free_cores_reads_this_machine():
    free = cpu.free_cores(0.02)
    assert 0.0 <= free <= cpu.cores()


def test_this_process_and_its_children_are_not_other_processes(monkeypatch):
    """The fork server ``dtrain run`` starts first imports torch on one core while the launcher looks: that
    core is dtrain's own, not busy with another job (it gave a one-slot run on 2 idle cores one thread)."""
    # Both cores 60% busy over the look (100 ticks each), 120 of those ticks this process tree's own.
    times = iter([{0: (0, 0), 1: (0, 0)}, {0: (40, 100), 1: (40, 100)}])
    own = iter([1000, 1120])
    monkeypatch.setattr(cpu, "_affinity", lambda: [0, 1])
    monkeypatch.setattr(cpu, "_cpu_times", lambda: next(times))
    monkeypatch.setattr(cpu, "_own_ticks", lambda: next(own))
    monkeypatch.setattr(cpu.time, "sleep", lambda seconds: None)
    assert cpu.free_cores() == pytest.approx(0.8 + 1.2)


def test_a_child_and_its_cpu_time_count_as_this_process_trees():
    import os
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 60
        while (mine := cpu._processes().get(child.pid, (0, 0)))[1] < 5:  # the child has spent CPU time
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        table = cpu._processes()
        assert child.pid in cpu.own_tree(table) and table[child.pid][0] == os.getpid()
        assert mine[1] >= 5
    finally:
        child.kill()
        child.wait()
