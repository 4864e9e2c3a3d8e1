"""The first steps apart from the steady state, and MFU: counted in a real run, in summary.json and
profile.json, shown by the summary, the doctor and the report; older profiles load without them."""

import json

import pytest
import torch
from profiles import make_profile

from dtrain.explain.doctor import diagnose, render
from dtrain.explain.efficiency import efficiency_lines
from dtrain.explain.summary import time_cost_table
from dtrain.profiling.flops import mfu_section
from dtrain.profiling.record import DeviceFacts, MatmulTflops, load_profile
from dtrain.profiling.timer import StepTimer
from dtrain.profiling.warmup import FirstStepsTimer

# The tiny trial's MLP (8 -> 16 -> 1) on one slot's 16 records: forward 2*16*(8*16 + 16*1) FLOPs; backward
# the weight gradients of both layers and the input gradient of the second (the data needs none).
TINY_STEP_FLOPS = 2 * 16 * (8 * 16 + 16) + 2 * 16 * (8 * 16 + 16 + 16)


@pytest.mark.slow
def test_a_run_counts_its_flops_and_times_its_first_steps(reference_runs):
    run = reference_runs.run_dir(1)
    summary = json.loads((run / "summary.json").read_text())
    profile = load_profile(run / "profile.json")
    flops, first = profile.flops, profile.first_steps
    assert flops is not None and first is not None
    assert summary["flops"] == flops.model_dump() and summary["first_steps"]["steps"] == first.steps
    assert flops.flops_per_step == TINY_STEP_FLOPS == flops.flops_per_step_all_slots
    step = profile.per_rank[0].seconds_per_step.step
    assert flops.mfu == pytest.approx(TINY_STEP_FLOPS / (step * flops.peak_flops_per_second))
    assert flops.peak_flops_per_second > 1e8 and "fp32 matmul" in flops.peak and 0 < flops.mfu < 1
    # The warm-up steps (3 by default) from this worker's start.
    assert first.steps == 3 and 0 < first.first_step_seconds <= first.seconds
    assert first.startup_seconds is not None and first.startup_seconds > 0
    assert first.time_to_first_step_seconds == pytest.approx(first.startup_seconds + first.first_step_seconds)
    assert first.steady_step_seconds == pytest.approx(profile.seconds_per_step.step.mean, rel=1e-6)
    assert first.excess_seconds == pytest.approx(max(0.0, first.seconds - 3 * first.steady_step_seconds))
    assert first.allocator_segments is None and first.autotuning == []  # CPU: no caching allocator, no cuDNN


def test_mfu_is_per_slot_and_in_total_against_the_precision_s_measured_peak():
    per_rank = [{"step": 0.010, "step_flops": 4e12}, {"step": 0.020, "step_flops": 4e12}]
    facts = DeviceFacts(type="cuda", name="NVIDIA H100", total_memory_bytes=8e10,
                        matmul_tflops=MatmulTflops(fp32=50.0, tf32=380.0, bf16=700.0, fp16=680.0))
    section = mfu_section(per_rank, "bf16-mixed", facts)
    assert section.peak_flops_per_second == 700e12 and section.peak == "bf16 matmul measured on NVIDIA H100"
    assert section.mfu_per_slot == pytest.approx([4e12 / (0.010 * 700e12), 4e12 / (0.020 * 700e12)])
    assert section.mfu == pytest.approx(sum(section.mfu_per_slot) / 2)
    assert section.flops_per_step_all_slots == 8e12
    assert mfu_section([{"step": 0.01, "step_flops": 0.0}], "32-true", facts) is None  # not counted: no MFU


def test_the_summary_the_doctor_and_the_report_say_it_and_old_profiles_load_without_it():
    old = make_profile([{"forward": 0.004, "backward": 0.006}])
    assert old.flops is None and old.first_steps is None and efficiency_lines(old) == []
    assert "MFU" not in time_cost_table(old) and diagnose(old).efficiency.mfu is None
    first = {"startup_seconds": 2.5, "first_step_seconds": 0.4, "time_to_first_step_seconds": 2.9, "steps": 3,
             "seconds": 0.5, "steady_step_seconds": 0.01, "excess_seconds": 0.47, "allocator_segments": 12,
             "allocator_segments_later": 0, "autotuning": []}
    flops = {"flops_per_step": 3e12, "flops_per_step_all_slots": 3e12, "peak_flops_per_second": 7e14,
             "peak": "bf16 matmul measured on NVIDIA H100", "mfu_per_slot": [0.43], "mfu": 0.43}
    new = make_profile([{"forward": 0.004, "backward": 0.006}], first_steps=first, flops=flops)
    lines = efficiency_lines(new)
    assert lines[0].startswith("first steps: 2.90 s to the first step (start-up 2.50 s, first step 400.0 ms)")
    assert "470.0 ms more than as many steady steps" in lines[0] and "12 new allocator segment(s)" in lines[0]
    assert lines[1].startswith("MFU: 43% of the bf16 matmul measured on NVIDIA H100 (700 TFLOP/s)")
    diagnosis = diagnose(new)
    assert diagnosis.efficiency.mfu == 0.43 and diagnosis.efficiency.first_steps_excess_seconds == 0.47
    assert diagnosis.to_json()["mfu_per_slot"] == [0.43] and diagnosis.to_json()["efficiency"] == lines
    for text in (time_cost_table(new), render(diagnosis)):
        assert all(line in text for line in lines)


def test_the_timer_stamps_only_its_first_steps():
    timer = FirstStepsTimer(torch.device("cpu"), warmup_steps=2)
    for _ in range(2):
        assert timer.start_step.__func__ is FirstStepsTimer.start_step
        timer.start_step()
        timer.end_step()
    # From then on the step timer's own methods: a steady step runs none of the first steps' code.
    assert timer.start_step.__func__ is StepTimer.start_step and timer.end_step.__func__ is StepTimer.end_step
    timer.start_step()
    timer.end_step()
    assert len(timer.first_steps.ends) == 2 and timer.steps == 3
