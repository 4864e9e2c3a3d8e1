"""`dtrain slurm` on a real Slurm: the generated script for the digits example, submitted with sbatch.

Uses the Slurm the environment points at (``sinfo`` answers), else starts the single-host cluster of
``scripts/slurm_cluster.sh`` when Slurm is installed (root) and takes it down afterwards; skipped, with
the reason, otherwise. The longer checks (scancel and --resume, requeue, two nodes, one task per slot)
are in ``bench/slurm_check.py``.
"""

from __future__ import annotations

import sys

import pytest
from helpers import ROOT

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
