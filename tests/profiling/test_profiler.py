"""The step profiler: its arithmetic on scripted clocks (host and deferred, as on CUDA), and on a real
2-slot run."""

import json

import pytest
from helpers import cli_in_process, tiny_config

from dtrain.profiling import PHASES, CommRecorder, StepTimer
from dtrain.profiling import timer as timer_module


class ScriptedClock:
    """A clock that returns scripted times; ``deferred`` mimics CUDA events (resolved at flush)."""

    def __init__(self, times, deferred):
        self.times = iter(times)
        self.deferred = deferred
        self.synchronized = 0

    def stamp(self):
        return next(self.times)

    def seconds(self, start, end):
        return end - start

    def synchronize(self):
        self.synchronized += 1

    def recycle(self):
        pass


def _timer(times, deferred, warmup=0):
    import torch

    t = StepTimer(torch.device("cpu"), enabled=True, warmup_steps=warmup, clock=ScriptedClock(times, deferred))
    return t


def _one_step(t, grad_ready=None):
    t.start_step()            # 0
    t.lap("data")             # 1
    t.backward_begin()        # forward until 3
    if grad_ready is not None:
        t.recorder.grad_ready, t.recorder.grad_ready_seen = grad_ready, True
    t.backward_end()
    t.lap("other")            # as ctx.step_optimizer: train_batch's own code, then the update
    t.lap("optimizer")
    t.end_step()


@pytest.mark.parametrize("deferred", [False, True])
def test_edges_become_phases_and_resolve_once_per_window(deferred):
    # start 0, data 1, forward 3, backward end 10 (last gradient at 7), other 11, optimizer 12, end 13
    times = [0.0, 1.0, 3.0, 10.0, 11.0, 12.0, 13.0] * 2
    t = _timer(times, deferred)
    _one_step(t, grad_ready=7.0)
    # A step only appends its edges (host or CUDA-style clock): nothing is resolved, nothing waited for.
    assert t.clock.synchronized == 0 and t.timed_steps == 0 and t.steps == 1
    _one_step(t, grad_ready=7.0)
    step = t.per_step()  # resolves what is pending: the only synchronization
    assert t.clock.synchronized == (1 if deferred else 0)
    assert step["data"] == 1 and step["forward"] == 2 and step["backward"] == 4 and step["comm_exposed"] == 3
    assert step["other"] == 1 + 1 - 0 and step["optimizer"] == 1 and step["step"] == 13
    assert sum(step[p] for p in PHASES) == step["step"]


@pytest.mark.parametrize("deferred", [False, True])
def test_steps_resolve_every_window(monkeypatch, deferred):
    monkeypatch.setattr(timer_module, "FLUSH_EVERY", 2)
    t = _timer([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0] * 4, deferred=deferred, warmup=1)
    for _ in range(4):
        _one_step(t)
    assert t.clock.synchronized == (2 if deferred else 0) and t.profiled_steps == 3 and t.steps == 4
    assert t.last_step_seconds == 6.0


def test_the_fetch_is_also_timed_on_the_host_clock(monkeypatch):
    """On CUDA the data phase is the device's clock: nothing while the device was busy with the queued steps.
    The host's own seconds of each fetch are kept apart (``data_host``), over the same steps as the phases."""
    host = iter([10.0, 10.003, 20.0, 20.002, 30.0, 30.004])  # (start, batch here) per step; the first is warm-up
    monkeypatch.setattr(timer_module.time, "perf_counter", lambda: next(host))
    t = _timer([0.0, 0.0, 2.0, 5.0, 5.0, 6.0, 6.0] * 3, deferred=True, warmup=1)
    for _ in range(3):
        t.start_step()
        t.data_lap()
        t.backward_begin()
        t.backward_end()
        t.lap("other")
        t.lap("optimizer")
        t.end_step()
    step = t.per_step()
    assert step["data"] == 0.0 and step["step"] == 6.0
    assert step["data_host"] == pytest.approx((0.002 + 0.004) / 2)


class StepClock:
    """Host-style clock whose edges are ``edge`` seconds apart; the test sets ``edge`` per step."""

    deferred = False

    def __init__(self):
        self.t, self.edge = 0.0, 1.0

    def stamp(self):
        self.t += self.edge
        return self.t

    def seconds(self, start, end):
        return end - start

    def synchronize(self):
        pass

    def recycle(self):
        pass


def _sampled_run(steps, sample_every, warmup=3):
    """A timer over ``steps`` steps whose edges are 1..7 s apart (by step); which steps it timed."""
    import torch

    clock = StepClock()
    t = StepTimer(torch.device("cpu"), warmup_steps=warmup, clock=clock, sample_every=sample_every)
    timed = []
    for i in range(steps):
        clock.edge = 1.0 + i % 7
        t.start_step()
        timed.append(t._in_step)
        t.lap("data")
        t.backward_begin()
        t.backward_end()
        t.lap("other")
        t.lap("optimizer")
        t.end_step()
    return t, timed


def test_sampling_times_few_steps_and_stays_unbiased():
    steps, k, warmup = 20_000, 4, 3
    t, timed = _sampled_run(steps, k, warmup)
    dense = timer_module.DENSE_STEPS
    # Every step up to the dense limit, then about one in k.
    assert all(timed[:warmup + dense]) and t.steps == steps
    step = t.per_step()  # resolves the pending steps
    expected_timed = dense + (steps - warmup - dense) / k
    assert abs(t.timed_steps - expected_timed) < 0.05 * expected_timed
    assert sum(timed) == t.timed_steps + warmup
    # Each timed step weighs k: the figures still stand for every profiled step, and their mean is the true
    # one (edges 1..7 s apart by step: mean step 6 x 4 s), not the mean of a biased subset.
    assert abs(t.profiled_steps - (steps - warmup)) < 0.05 * steps
    assert step["step"] == pytest.approx(6 * 4.0, rel=0.03)
    assert step["data"] == pytest.approx(4.0, rel=0.03)
    assert sum(step[p] for p in PHASES) == pytest.approx(step["step"])


def test_every_rank_samples_the_same_steps():
    # Ranks run the same steps: their timers must time the same ones (straggler samples align by index).
    assert _sampled_run(3_000, 4)[1] == _sampled_run(3_000, 4)[1]


def test_sample_every_one_times_every_step():
    t, timed = _sampled_run(500, 1)
    t.per_step()
    assert all(timed) and t.timed_steps == t.profiled_steps == 500 - 3


def test_busy_time_is_the_union_of_intervals():
    rec = CommRecorder()
    rec.launches = [0.0, 1.0, 5.0]
    rec.completions = [2.0, 3.0, 6.0]
    assert rec.busy_seconds() == 4.0  # [0,3] + [5,6]
    assert rec.busy_seconds(lo=2.5, hi=5.5) == 1.0  # [2.5,3] + [5,5.5]


@pytest.mark.slow
def test_phases_add_up_and_exposed_never_exceeds_busy(tmp_path):
    cfg = tiny_config(tmp_path, **{"max_length": {"batches": 60}, "hyperparameters.train_size": 1024})
    result = cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet")
    assert result.code == 0, result.stderr
    profile = json.loads((tmp_path / "r" / "profile.json").read_text())
    assert profile["slots"] == 2 and profile["profiled_steps"] == 60 - 3
    params = 8 * 16 + 16 + 16 + 1
    for rank in profile["per_rank"]:
        phases = rank["seconds_per_step"]
        total = sum(phases[p] for p in PHASES)
        assert abs(total - phases["step"]) <= 0.03 * phases["step"], (total, phases["step"])
        assert phases["comm_exposed"] <= rank["comm_busy_seconds_per_step"] + 1e-9
        assert rank["comm_bytes_per_step"] == params * 4  # every gradient, fp32, once per step
        assert rank["comm_buckets_per_step"] >= 1
    spread = profile["seconds_per_step"]["step"]
    assert spread["min"] <= spread["mean"] <= spread["max"]
    assert profile["comm"]["algbw_bytes_per_second"] > 0
    # Throughput: profiled steps / their time, and every step / the device-synchronized training time.
    rank0_step = profile["per_rank"][0]["seconds_per_step"]["step"]
    assert profile["samples_per_second"] == pytest.approx(16 / rank0_step, rel=1e-6)
    assert 0 < profile["train_seconds"] <= profile["wall_seconds"]
    all_steps = profile["steps"] * 16 / profile["train_seconds"]
    assert profile["samples_per_second_all_steps"] == pytest.approx(all_steps, rel=1e-6)
    # --quiet ends in one line; the table and the verdict are one command away.
    report = cli_in_process("report", str(tmp_path / "r"))
    assert "time cost per step" in report.stdout and "doctor:" in report.stdout


@pytest.mark.slow
def test_profiling_off_still_measures_throughput_honestly(tmp_path):
    cfg = tiny_config(tmp_path, **{"max_length": {"batches": 10}, "profiling.enabled": False})
    result = cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet")
    assert result.code == 0, result.stderr
    assert not (tmp_path / "r" / "profile.json").exists()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["samples_per_second"] == pytest.approx(10 * 16 / summary["train_seconds"], rel=1e-6)


def test_the_last_gradient_is_stamped_where_ddp_says_backward_ends():
    """A head defined before the body: the first parameter is not the last one backward reaches. The
    guess (the first parameter) is stamped until DDP logs its gradients' order, then the true last one."""
    import torch
    from torch import nn

    import dtrain
    from dtrain.profiling.comm import DDPTiming

    class HeadFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.head, self.body = nn.Linear(8, 2), nn.Linear(4, 8)

        def forward(self, x):
            return self.head(torch.relu(self.body(x)))

    class Recording(CommRecorder):
        __slots__ = ("seen",)

        def mark_grad_ready(self, param):
            self.seen.append(param)

    ctx = dtrain.init(seed=0, quiet=True)
    try:
        module = HeadFirst()
        ddp = nn.parallel.DistributedDataParallel(module)
        timer = StepTimer(torch.device("cpu"), enabled=True, warmup_steps=0)
        recorder = timer.recorder = Recording(timer.clock)
        recorder.seen = []
        DDPTiming(recorder, native=True).attach(ddp, module)
        last_seen = []
        for _ in range(4):
            recorder.seen.clear()
            timer.start_step()
            ddp(torch.randn(3, 4)).sum().backward()
            timer.end_step()
            last_seen.append(recorder.seen[-1])
        # Steps 1 and 2: the guess; DDP logs the order during its second forward, read after step 2.
        assert last_seen == [module.head.weight, module.head.weight, module.body.weight, module.body.weight]
        assert recorder.settle is None  # settled: no further look at DDP's data
    finally:
        ctx.close()


@pytest.mark.parametrize("deferred", [False, True])
def test_collectives_are_timed_by_the_steps_clock(deferred):
    """A comm hook's buckets are stamped with the step's own clock: CUDA events (deferred) on a GPU, resolved
    with the window, never host times around asynchronous NCCL calls, which only say when they were queued."""
    # start 0, data 1, forward 3; buckets launched at 4 and 5, completed at 6 and 8 (overlapping: busy 4);
    # last gradient 7; backward end 10, other 11, optimizer 12, end 13
    times = [0.0, 1.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 11.0, 12.0, 13.0]
    t = _timer(times, deferred)
    t.start_step()
    t.lap("data")
    t.backward_begin()
    t.recorder.launch(1000)
    t.recorder.launch(1000)
    t.recorder.complete()
    t.recorder.complete()
    t.recorder.grad_ready, t.recorder.grad_ready_seen = 7.0, True
    t.backward_end()
    t.lap("other")
    t.lap("optimizer")
    t.end_step()
    step = t.per_step()
    assert step["comm_busy"] == 4.0 and step["comm_bytes"] == 2000 and step["comm_buckets"] == 2
    assert step["comm_exposed"] == 3.0 and step["backward"] == 4.0 and step["step"] == 13.0
    assert t.clock.synchronized == (1 if deferred else 0)
