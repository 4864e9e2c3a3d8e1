"""`dtrain slurm` on a real Slurm: the generated sbatch script for the digits example, submitted with sbatch.

    .venv/bin/python bench/slurm_check.py [--checks one_node,cancel_resume,requeue,two_nodes,srun_per_slot]

Uses the Slurm the environment already points at (``sinfo`` answers), else brings up the single-host test
cluster of ``scripts/slurm_cluster.sh`` (root; installs Slurm with apt when missing) with two slurmd on
this host (``DTRAIN_SLURM_NODES=2``), and takes it down again afterwards. The checks:

* ``one_node``: 1 node x 2 slots reaches COMPLETED; the run directory holds the final checkpoint and
  validation accuracy >= 0.95; each worker had the job's CPUs (not one core for both).
* ``cancel_resume``: ``scancel`` while training stops every process of the job (none left) and leaves a
  checkpoint; the script made with ``dtrain slurm --resume RUN_DIR`` continues that run to COMPLETED.
* ``requeue``: ``scontrol requeue`` while training: the job runs again under the same id and resumes its
  own run directory (the script detects the checkpoint), appending to the same output file.
* ``two_nodes``: 2 nodes x 1 slot (one srun task per node, the c10d rendezvous on the first node); needs a
  cluster with 2 nodes (here: two slurmd on one host, so the "nodes" share the machine and loopback).
* ``srun_per_slot``: a hand-written script, ``srun --ntasks=2 dtrain run``: each task trains in place.

The test ``tests/launcher/test_slurm.py`` runs ``one_node`` only (and is skipped when no Slurm can be started).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "digits" / "experiment.yaml"
CLUSTER = ROOT / "scripts" / "slurm_cluster.sh"
# 10 epochs on 2 slots: validation accuracy 0.96 (0.908 after 3, 0.958 after 4 but 0.90-0.92 after 6-7).
EPOCHS = 10
MIN_ACCURACY = 0.95
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
               "BOOT_FAIL", "DEADLINE"}


class SlurmUnavailable(Exception):
    """No Slurm answers and none could be started here (the reason is the message)."""


@dataclass
class Cluster:
    """A Slurm the checks submit to; ``env`` holds SLURM_CONF when it is the script's own cluster."""

    env: dict[str, str]
    nodes: int
    started_here: bool

    def run(self, *argv: str, timeout: float = 30, check: bool = True) -> str:
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout


def _answers(env: dict[str, str]) -> int | None:
    """Node count of the Slurm ``env`` points at, or None when none answers."""
    if shutil.which("sinfo") is None:
        return None
    try:
        result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True,
                                timeout=15)
    except (subprocess.TimeoutExpired, OSError):
        return None
    lines = [line for line in result.stdout.splitlines() if line.strip() and "down" not in line]
    return len({line.split()[0] for line in lines}) if result.returncode == 0 and lines else None


def _script_env() -> dict[str, str]:
    out = subprocess.run(["bash", str(CLUSTER), "env"], capture_output=True, text=True, check=True).stdout
    conf = out.strip().split("=", 1)[1]
    return {**os.environ, "SLURM_CONF": conf}


SLURM_PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")


@contextlib.contextmanager
def slurm_cluster(nodes: int = 1, install: bool = True) -> Iterator[Cluster]:
    """A Slurm to submit to: the one already answering, else the script's cluster, started (and taken
    down at the end) here; ``install``: let the script install Slurm with apt when it is missing.
    Raises SlurmUnavailable with the reason when there is none."""
    for env in (dict(os.environ), _script_env()):
        # sinfo spends a minute retrying a SLURM_CONF that does not exist: ask only where one does.
        if "SLURM_CONF" in env and not Path(env["SLURM_CONF"]).exists():
            continue
        found = _answers(env)
        if found:
            yield Cluster(env, found, started_here=False)
            return
    if os.geteuid() != 0:
        raise SlurmUnavailable("no Slurm answers (sinfo) and starting one needs root (os.geteuid() != 0)")
    missing = [p for p in SLURM_PROGRAMS if shutil.which(p) is None]
    if missing and not install:
        raise SlurmUnavailable(f"no Slurm answers and it is not installed (no {', '.join(missing)}); "
                               "`scripts/slurm_cluster.sh up` installs it (apt) and starts one")
    if missing and shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"no Slurm installed (no {', '.join(missing)}) and no apt-get to install it")
    env = {**os.environ, "DTRAIN_SLURM_NODES": str(nodes)}
    up = subprocess.run(["bash", str(CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=600)
    try:
        if up.returncode != 0:
            raise SlurmUnavailable(f"scripts/slurm_cluster.sh up failed: {(up.stderr or up.stdout).strip()}")
        cluster_env = _script_env()
        yield Cluster(cluster_env, _answers(cluster_env) or 0, started_here=True)
    finally:
        subprocess.run(["bash", str(CLUSTER), "down"], capture_output=True, text=True, timeout=180)


# ------------------------------------------------------------------------------------------- jobs


def dtrain_cmd() -> str:
    """How the job runs dtrain: this interpreter (the venv), niced, since the machine is shared."""
    return f"nice -n 10 {sys.executable} -m dtrain.cli"


def generate(cluster: Cluster, workdir: Path, nodes: int, *extra: str, name: str = "job.sh") -> Path:
    """``dtrain slurm`` for the digits example, written to ``workdir/name``."""
    argv = [sys.executable, "-m", "dtrain.cli", "slurm", str(CONFIG), "--nodes", str(nodes), "--time", "00:10:00",
            "--dtrain", dtrain_cmd(), "--set", f"max_length.epochs={EPOCHS}", *extra]
    script = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True, cwd=workdir).stdout
    path = workdir / name
    path.write_text(script)
    return path


def submit(cluster: Cluster, script: Path) -> str:
    out = cluster.run("sbatch", "--parsable", f"--chdir={script.parent}", str(script))
    return out.strip().split(";")[0]


def job_state(cluster: Cluster, job: str) -> dict[str, str]:
    """``scontrol show job``'s fields (JobState, ExitCode, Restarts, ...)."""
    out = cluster.run("scontrol", "show", "job", "-o", job, check=False)
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_state(cluster: Cluster, job: str, states: set[str], timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        info = job_state(cluster, job)
        if info.get("JobState") in states:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job} not in {sorted(states)} after {timeout:.0f}s: {info.get('JobState')}")
        time.sleep(0.5)


def wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.5)


def job_pids(job: str) -> list[int]:
    """Processes on this machine that belong to ``job`` (they inherit SLURM_JOB_ID)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if f"\0SLURM_JOB_ID={job}\0" in "\0" + (proc / "environ").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
    return pids


def cancel(cluster: Cluster, job: str) -> None:
    """scancel, tolerant of a job already gone (teardown)."""
    cluster.run("scancel", job, check=False)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def check_finished_run(run_dir: Path, slots: int) -> dict:
    """The run directory of a finished digits run: final checkpoint, accuracy, every rank's log."""
    latest = run_dir / "checkpoints" / "latest"
    assert latest.exists(), f"no checkpoint in {run_dir}"
    final = run_dir / "checkpoints" / latest.read_text().strip()
    assert (final / "metadata.json").exists() and (final / "model.pt").exists(), final
    done = summary(run_dir)
    assert done["epochs"] == EPOCHS, done["epochs"]
    accuracy = done["validation"]["accuracy"]
    assert accuracy >= MIN_ACCURACY, f"validation accuracy {accuracy:.4f} < {MIN_ACCURACY}"
    for rank in range(slots):
        assert (run_dir / "logs" / f"rank{rank}.log").exists(), rank
    return done


def sacct_lines(cluster: Cluster, jobs: list[str]) -> str:
    """``sacct -c`` (job completion records, jobcomp/filetxt) for ``jobs``, when the cluster keeps them."""
    result = subprocess.run(["sacct", "-c", "-j", ",".join(jobs), "-o", "JobID,JobName,NNodes,NodeList,State,End"],
                            env=cluster.env, capture_output=True, text=True, timeout=30)
    return result.stdout if result.returncode == 0 else f"(sacct -c: {result.stderr.strip()})"


# ----------------------------------------------------------------------------------------- checks


def _worker_cpus(job: str) -> set[str]:
    """Cpus_allowed_list of the job's training workers, read while they run."""
    found = set()
    for pid in job_pids(job):
        with contextlib.suppress(OSError):
            if b"dtrain.engine.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                status = Path(f"/proc/{pid}/status").read_text()
                found.add(re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1))  # type: ignore[union-attr]
    return found


def check_one_node(cluster: Cluster, work: Path, jobs: list[str]) -> str:
    """1 node x 2 slots to COMPLETED, checkpoint and accuracy; the workers' CPUs while they run."""
    job = submit(cluster, generate(cluster, work, 1))
    jobs.append(job)
    cpus: set[str] = set()
    deadline = time.monotonic() + 240
    while job_state(cluster, job).get("JobState") not in DONE_STATES and time.monotonic() < deadline:
        cpus |= _worker_cpus(job)
        time.sleep(0.5)
    info = wait_state(cluster, job, DONE_STATES, 1)
    out = (work / f"digits-{job}.out").read_text() if (work / f"digits-{job}.out").exists() else ""
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-3000:])
    done = check_finished_run(work / "runs" / f"digits-{job}", 2)
    # Both workers had the job's 2 CPUs (with one CPU per task, task/affinity put both on one core).
    assert done["device_facts"]["cores"] >= 2, done["device_facts"]
    return (f"job {job} COMPLETED: accuracy {done['validation']['accuracy']:.4f}, {done['epochs']:g} epochs, "
            f"workers' CPUs {sorted(cpus) or '?'}")


def _submit_and_wait_checkpoint(cluster: Cluster, script: Path, jobs: list[str]) -> tuple[str, Path]:
    job = submit(cluster, script)
    jobs.append(job)
    run_dir = script.parent / "runs" / f"digits-{job}"
    # A checkpoint every 2 epochs: wait for the first, then interrupt mid-run.
    wait_for(lambda: (run_dir / "checkpoints" / "latest").exists(), 180, f"job {job}'s first checkpoint")
    return job, run_dir


def check_cancel_resume(cluster: Cluster, work: Path, jobs: list[str]) -> str:
    """scancel while training: no process left, a checkpoint left; --resume continues to COMPLETED."""
    first, run_dir = _submit_and_wait_checkpoint(
        cluster, generate(cluster, work, 1, "--set", "min_checkpoint_period.epochs=2", name="cancel.sh"), jobs)
    assert job_pids(first), f"job {first} has no process running"
    cancelled_at = time.monotonic()
    cancel(cluster, first)
    wait_state(cluster, first, {"CANCELLED"}, 60)
    wait_for(lambda: not job_pids(first), 60, f"every process of cancelled job {first} gone")
    gone = time.monotonic() - cancelled_at
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert not (run_dir / "summary.json").exists(), "the cancelled run finished before scancel"
    out = (work / f"digits-{first}.out").read_text()
    assert "dtrain: stopped by SIGTERM" in out and "Traceback" not in out, out[-3000:]
    script = generate(cluster, work, 1, "--set", "min_checkpoint_period.epochs=2", "--resume",
                      str(run_dir), name="resume.sh")
    second = submit(cluster, script)
    jobs.append(second)
    info = wait_state(cluster, second, DONE_STATES, 240)
    out = (work / f"digits-{second}.out").read_text()
    assert info["JobState"] == "COMPLETED", (info, out[-3000:])
    done = check_finished_run(run_dir, 2)
    return (f"job {first} CANCELLED at checkpoint {latest}, all its processes gone {gone:.1f}s after scancel; "
            f"job {second} (--resume) COMPLETED the same run: accuracy {done['validation']['accuracy']:.4f}")


def check_requeue(cluster: Cluster, work: Path, jobs: list[str]) -> str:
    """scontrol requeue while training: same job id, same run directory, resumed, COMPLETED."""
    job, run_dir = _submit_and_wait_checkpoint(
        cluster, generate(cluster, work, 1, "--set", "min_checkpoint_period.epochs=2", name="requeue.sh"), jobs)
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    cluster.run("scontrol", "requeue", job)
    # A requeued job is held back a while (Reason=BeginTime, minutes here) before it runs again: make it
    # eligible now.
    wait_state(cluster, job, {"PENDING"}, 60)
    cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now")
    info = wait_state(cluster, job, DONE_STATES - {"PREEMPTED"}, 300)
    out = (work / f"digits-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "1", (info, out[-3000:])
    check_finished_run(run_dir, 2)
    assert out.count("dtrain: run directory") == 2, out[-3000:]  # both attempts' output, appended
    return f"job {job} requeued at checkpoint {latest}, ran again (Restarts=1) and COMPLETED its own run"


def check_two_nodes(cluster: Cluster, work: Path, jobs: list[str]) -> str:
    """2 nodes x 1 slot: one srun task (agent) per node, rendezvous on the first node."""
    if cluster.nodes < 2:
        return f"skipped: the cluster has {cluster.nodes} node(s)"
    job = submit(cluster, generate(cluster, work, 2, name="two.sh"))
    jobs.append(job)
    info = wait_state(cluster, job, DONE_STATES, 300)
    out = (work / f"digits-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", (info, out[-3000:])
    done = check_finished_run(work / "runs" / f"digits-{job}", 2)
    return f"job {job} on {info.get('NodeList')} COMPLETED: accuracy {done['validation']['accuracy']:.4f}"


def check_srun_per_slot(cluster: Cluster, work: Path, jobs: list[str]) -> str:
    """srun with one task per slot, no agent: each task trains in place with Slurm's ranks."""
    script = work / "per_slot.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --job-name=digits\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n"
        "#SBATCH --cpus-per-task=1\n#SBATCH --time=00:10:00\n#SBATCH --output=digits-%j.out\nset -euo pipefail\n"
        # dtrain takes the first node's name as the master: where names do not resolve (the two-slurmd test
        # cluster's HOST-1, HOST-2), the script says where the first node is, as `dtrain slurm`'s does.
        'FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        "export MASTER_ADDR=$(scontrol show node \"$FIRST_NODE\" | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')\n"
        f"srun --kill-on-bad-exit=1 {dtrain_cmd()} run {CONFIG} --set max_length.epochs={EPOCHS} "
        '--run-dir "runs/digits-$SLURM_JOB_ID" --quiet\n')
    job = submit(cluster, script)
    jobs.append(job)
    info = wait_state(cluster, job, DONE_STATES, 300)
    out = (work / f"digits-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", (info, out[-3000:])
    done = check_finished_run(work / "runs" / f"digits-{job}", 2)
    return f"job {job} (2 tasks, in place) COMPLETED: accuracy {done['validation']['accuracy']:.4f}"


CHECKS = {"one_node": check_one_node, "cancel_resume": check_cancel_resume, "requeue": check_requeue,
          "two_nodes": check_two_nodes, "srun_per_slot": check_srun_per_slot}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated, of: " + ", ".join(CHECKS))
    parser.add_argument("--keep", action="store_true", help="keep the working directory (job outputs, runs)")
    args = parser.parse_args()
    names = [n for n in args.checks.split(",") if n]
    unknown = set(names) - set(CHECKS)
    if unknown:
        parser.error(f"unknown checks: {', '.join(sorted(unknown))}")
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="dtrain-slurm-check-"))
    failed = 0
    try:
        with slurm_cluster(nodes=2) as cluster:
            print(f"slurm_check: {'started' if cluster.started_here else 'using'} a Slurm with {cluster.nodes} "
                  f"node(s); working directory {work}", flush=True)
            jobs: list[str] = []
            try:
                for name in names:
                    t0 = time.monotonic()
                    try:
                        result = CHECKS[name](cluster, work, jobs)
                        print(f"  {name}: ok ({time.monotonic() - t0:.0f}s): {result}", flush=True)
                    except AssertionError as exc:
                        failed += 1
                        print(f"  {name}: FAILED ({time.monotonic() - t0:.0f}s): {exc}", flush=True)
            finally:
                for job in jobs:
                    cancel(cluster, job)
            print(f"\n$ sacct -c -j {','.join(jobs)}\n{sacct_lines(cluster, jobs)}")
    except SlurmUnavailable as exc:
        print(f"slurm_check: skipped: {exc}")
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"slurm_check: {len(names) - failed}/{len(names)} checks passed in {time.monotonic() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
