"""`dtrain slurm` on a real Slurm: the generated script for the digits example, submitted with sbatch.

Uses the Slurm the environment points at (``sinfo`` answers), else starts the single-host cluster of
``scripts/slurm_cluster.sh`` when Slurm is installed (root) and takes it down afterwards; skipped, with
the reason, otherwise. The longer checks (scancel and --resume, requeue, two nodes, one task per slot)
are in ``bench/slurm_check.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT, cli_in_process, tiny_config

sys.path.insert(0, str(ROOT / "bench"))
import slurm_check


@pytest.fixture(scope="module")
def slurm():
    """The cluster; never installs packages from a test (the bench and the script do)."""
    try:
        with slurm_check.slurm_cluster(nodes=1, install=False) as cluster:
            yield cluster
    except slurm_check.SlurmUnavailable as exc:
        pytest.skip(f"Slurm: {exc}")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sbatch_script_trains_digits_to_completion(slurm, tmp_path):
    """1 node x 2 slots: COMPLETED, final checkpoint, validation accuracy >= 0.95, both workers given the
    job's CPUs (not one core for the two)."""
    jobs: list[str] = []
    try:
        result = slurm_check.check_one_node(slurm, tmp_path, jobs)
    finally:
        for job in jobs:  # a failed or timed-out test leaves no job behind
            slurm_check.cancel(slurm, job)
    print(result)


def _run_script_with_stub_srun(tmp_path, script: str) -> list[str]:
    """Run ``script`` with stand-ins for scontrol and srun; return the arguments srun got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\n[ \"$2\" = hostnames ] && echo node1\n"
                                      "[ \"$2\" = node ] && echo '   NodeAddr=10.0.0.7 NodeHostName=node1'\nexit 0\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/srun-args\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node1"}
    (tmp_path / "job.sh").write_text(script)
    subprocess.run(["bash", "job.sh"], cwd=tmp_path, env=env, check=True, timeout=30)
    return (tmp_path / "srun-args").read_text().splitlines()


def test_script_resumes_a_requeued_job_and_names_its_master_by_address(tmp_path):
    """What the real Slurm showed, checked without one: one CPU per local worker on srun as well, the
    master at the first node's NodeAddr, and a requeued job (same id) resuming its own run directory
    (or, with no checkpoint yet, keeping the first attempt aside)."""
    cfg = str(tiny_config(tmp_path, **{"resources.slots_per_trial": 2}))
    script = cli_in_process("slurm", cfg, "--nodes", "1").stdout
    for line in ("#SBATCH --cpus-per-task=2", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert line in script, line
    args = _run_script_with_stub_srun(tmp_path, script)
    assert "--cpus-per-task=2" in args and "--resume" not in args
    assert args[args.index("--master") + 1] == "10.0.0.7:20042"
    run_dir = tmp_path / "runs" / "tiny-42"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("{}\n")
    args = _run_script_with_stub_srun(tmp_path, script)
    assert "--resume" not in args and not run_dir.exists()  # no checkpoint: set aside, started again
    assert len(list((tmp_path / "runs").glob("tiny-42.attempt-*"))) == 1
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("10\n")
    args = _run_script_with_stub_srun(tmp_path, script)
    assert args[args.index("--resume") + 1] == "runs/tiny-42" and args[args.index("--run-dir") + 1] == "runs/tiny-42"
    resumed = cli_in_process("slurm", cfg, "--nodes", "1", "--resume", "runs/old").stdout
    args = _run_script_with_stub_srun(tmp_path, resumed)
    assert args[args.index("--resume") + 1] == "runs/old" and args[args.index("--run-dir") + 1] == "runs/old"
