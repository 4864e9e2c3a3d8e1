"""Failures that explain themselves: no orphan workers, locked run directories, clean stops, culprits named.

Each test starts a real run in its own process group and kills everything it started, whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, cli_in_process, final_weights, tiny_config

# Every batch of rank 1 sleeps this long: the run lasts long enough to be signalled mid-training.
SLOW = {"hyperparameters.sleep_rank": 1, "hyperparameters.sleep_seconds": 0.25}


class Run:
    """``dtrain run`` in the background, in its own session; :meth:`close` kills whatever is left."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", *args], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.workers: list[int] = []

    def statuses(self, run_dir: Path) -> dict[int, dict]:
        found = {}
        for path in (run_dir / "logs").glob("status.rank*.json"):
            with contextlib.suppress(OSError, ValueError):
                record = json.loads(path.read_text())
                found[record["rank"]] = record
        return found

    def wait_training(self, run_dir: Path, ranks: int, batch: int = 1, timeout: float = 90) -> dict[int, dict]:
        """Until every rank published a status at ``batch`` or later; returns the statuses."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.reached(run_dir, ranks, batch)
            if found is not None:
                return found
            time.sleep(0.2)
        raise AssertionError(f"ranks never reached batch {batch}: {self.statuses(run_dir)}")

    def reached(self, run_dir: Path, ranks: int, batch: int) -> dict[int, dict] | None:
        """The statuses, once every rank published one at ``batch`` or later (the run must still be going)."""
        assert self.proc.poll() is None, self.proc.communicate()
        found = self.statuses(run_dir)
        if len(found) == ranks and all((s["batch"] or 0) >= batch for s in found.values()):
            self.workers = [s["pid"] for s in found.values()]
            return found
        return None

    def wait(self, timeout: float) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.workers:  # in sessions of their own: out of the group's reach
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.communicate(timeout=10)


@contextlib.contextmanager
def background(*args: str):
    run = Run(*args)
    try:
        yield run
    finally:
        run.close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _one_line(err: str, fragment: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err


# --------------------------------------------------------------------------- 1. no orphans, one run per dir


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    """Two long runs (400 slow batches), started together so that their starts overlap: one for each way of
    killing the launcher below; each is killed by its test, or at the end of the module."""
    with contextlib.ExitStack() as stack:
        runs = {}
        for target in ("launcher", "group"):
            tmp = tmp_path_factory.mktemp(f"long-{target}")
            cfg = tiny_config(tmp, **SLOW, **{"max_length": {"batches": 400}})
            runs[target] = (stack.enter_context(background(str(cfg), "--run-dir", str(tmp / "r"), "--quiet")),
                            cfg, tmp / "r")
        yield runs


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "group"])
def test_workers_die_with_their_launcher_and_the_run_dir_is_locked(long_runs, target):
    run, cfg, run_dir = long_runs[target]
    run.wait_training(run_dir, ranks=2)
    if target == "launcher":  # the second run fails at once: the directory is in use
        second = cli_in_process("run", str(cfg), "--resume", str(run_dir))
        assert second.code == 2 and "is in use by another dtrain run" in second.stderr, second.stderr
    killed = time.monotonic()
    if target == "group":  # what `timeout -s KILL` or a CI runner does
        os.killpg(run.proc.pid, signal.SIGKILL)
    else:  # what the OOM killer does
        os.kill(run.proc.pid, signal.SIGKILL)
    while any(_alive(pid) for pid in run.workers) and time.monotonic() - killed < 10:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in run.workers), "a worker outlived its launcher by 10 s"


# ------------------------------------------------------------------------------------------ 2. clean stops


@pytest.mark.slow
def test_sigterm_checkpoints_where_the_ranks_agree_and_resumes_bit_identical(tmp_path, reference_runs):
    # The file says 1 slot and 12 batches; the run was started with 2 and 24: the command printed at the
    # stop must continue the run as started, not as the file says.
    cfg = tiny_config(tmp_path, **SLOW, **{"max_length": {"batches": 12}, "resources.slots_per_trial": 1})
    run_dir = tmp_path / "r"
    with background(str(cfg), "--run-dir", str(run_dir), "--quiet", "--slots", "2",
                    "--set", "max_length.batches=24") as run:
        run.wait_training(run_dir, ranks=2, batch=3)
        signalled = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        code, _, err = run.wait(timeout=60)
        took = time.monotonic() - signalled
    assert code == 143, err
    _one_line(err, "dtrain: stopped at batch ")
    batch = int(err.split("stopped at batch ")[1].split()[0])
    assert f"by SIGTERM; resume with: dtrain run --resume {run_dir}" in err
    assert 3 <= batch < 24 and (run_dir / "checkpoints" / "latest").read_text().strip() == str(batch)
    assert took < 15, f"took {took:.1f}s to stop"  # 5 s on an idle machine; this one is shared
    assert not (run_dir / "summary.json").exists()  # an unfinished run has no results yet

    printed = shlex.split(err.split("resume with: ")[1])  # the command as printed: the run's own settings
    resumed = cli_in_process(*printed[1:], "--quiet", "--set", "hyperparameters.sleep_seconds=0")
    assert resumed.code == 0, resumed.stderr
    straight, after = reference_runs.weights(2), final_weights(run_dir)
    assert straight.keys() == after.keys()
    assert all(torch.equal(straight[k], after[k]) for k in straight)


# ------------------------------------------------------------------------------------ 3. the culprit named

# Rank 1 first sleeps 1 s at batch 8 (its status is published meanwhile), then does what each case says.
FAULTS = {
    "hang": {"hyperparameters.sleep_seconds": 120},
    "freeze": {"hyperparameters.sleep_seconds": 1, "hyperparameters.freeze_at_batch": 8},
    "kill": {"hyperparameters.sleep_seconds": 1, "hyperparameters.kill_at_batch": 8},
}
EXPECTED = {
    "hang": "rank 1 on host {host} (pid {pid}) stopped in train_batch at batch 8, ",
    "freeze": "rank 1 on host {host} (pid {pid}) stopped answering in train_batch at batch 8, ",
    "kill": "worker rank 1 failed: killed by signal SIGKILL (host {host}, pid {pid}, in train_batch at batch 8)",
}


@pytest.fixture(scope="module")
def silent_ranks(tmp_path_factory) -> dict[str, tuple[int, str, float, dict[int, dict]]]:
    """Each fault's job, all started together: each mostly waits (for its collective timeout, or for a status
    to age), so their waits overlap instead of adding up. Per fault: the exit code, stderr, the seconds from
    the moment every rank was seen at batch 8 to the job's end, and the statuses seen then."""
    jobs = {}
    with contextlib.ExitStack() as stack:
        for fault in sorted(FAULTS):
            tmp = tmp_path_factory.mktemp(fault)
            cfg = tiny_config(tmp, **FAULTS[fault], **{
                "hyperparameters.sleep_rank": 1, "hyperparameters.sleep_at_batch": 8,
                "resources.collective_timeout_seconds": 5, "max_length": {"batches": 40}})
            jobs[fault] = (stack.enter_context(background(str(cfg), "--run-dir", str(tmp / "r"), "--quiet")), tmp / "r")
        stuck: dict[str, tuple[float, dict[int, dict]]] = {}
        ended: dict[str, float] = {}
        deadline = time.monotonic() + 180
        while len(ended) < len(jobs):  # one loop watches every job: none is seen late for waiting on another
            assert time.monotonic() < deadline, f"stuck at {sorted(stuck)}, ended {sorted(ended)}"
            for fault, (run, run_dir) in jobs.items():
                if fault not in stuck:
                    statuses = run.reached(run_dir, ranks=2, batch=8)
                    if statuses is not None:
                        stuck[fault] = (time.monotonic(), statuses)
                elif fault not in ended and run.proc.poll() is not None:
                    ended[fault] = time.monotonic()
            time.sleep(0.1)
        results = {}
        for fault, (run, _) in jobs.items():
            code, _, err = run.wait(timeout=10)
            results[fault] = (code, err, ended[fault] - stuck[fault][0], stuck[fault][1])
    return results


# The deadline below is set by timers (collective timeout, status age), with slack far above what the
# suite's own load adds; the jobs mostly wait, so they cost the other tests little.
@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_silent_rank_is_named_and_fails_the_job_within_the_timeout(silent_ranks, fault):
    code, err, took, statuses = silent_ranks[fault]
    assert code == 1, err
    culprit = statuses[1]
    assert EXPECTED[fault].format(host=culprit["host"], pid=culprit["pid"]) in err, err
    if fault != "kill":
        assert "rank 0 waited in backward (gradient all-reduce) at batch 8 and timed out after 5 s" in err
        assert took < 5 + 10 + 10, f"{took:.1f}s"  # timeout + 10 s, plus slack for this shared machine
    assert "unbound_buffer" not in err and "Traceback" not in err  # Gloo's own words: in the rank's log
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 2  # the error, then where the log is


# --------------------------------------------------------------------------------- 4. non-finite losses


@pytest.mark.slow
def test_a_nan_loss_fails_naming_its_rank_or_is_skipped_on_every_rank(tmp_path):
    cfg = tiny_config(tmp_path, **{"hyperparameters.nan_at_batch": 13, "min_checkpoint_period": {"batches": 6},
                                   "checkpoint_storage.save_trial_latest": 1})
    failed = cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "fail"), "--quiet")
    assert failed.code == 1, failed.stderr
    # Found where the ranks next compare notes: the report after batch 16, or, where that report was held
    # back for the next stop vote (dtrain.engine.trainer), the checkpoint after batch 18.
    assert re.search("worker rank 1 failed: NonFiniteError: the loss became non-finite \\(nan or inf\\) on rank 1 "
                     "at batch 13; stopped (at the report at batch 16|before the checkpoint at batch 18)",
                     failed.stderr), failed.stderr
    ckpts = tmp_path / "fail" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["12", "latest"]  # no checkpoint with nan weights
    assert all(torch.isfinite(t).all() for t in final_weights(tmp_path / "fail").values())

    skipped = cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "skip"), "--quiet", "--slots", "1",
                         "--set", "optimizations.on_nonfinite=skip", "--set", "hyperparameters.crash_rank=0")
    assert skipped.code == 0, skipped.stderr
    summary = json.loads((tmp_path / "skip" / "summary.json").read_text())
    assert summary["nonfinite_skipped_steps"] == 1 and summary["batches"] == 24
    assert all(torch.isfinite(t).all() for t in final_weights(tmp_path / "skip").values())
    records = [json.loads(ln) for ln in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["metrics"]["loss"] is not None for r in records if r["kind"] == "training")


def _fake_checkpoint(root: Path, batches: int, finite: bool = True) -> None:
    folder = root / str(batches)
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"weights")
    (folder / "metadata.json").write_text(json.dumps({"batches": batches, "finite": finite}))


def test_rotation_keeps_the_newest_finite_checkpoint_and_prunes_atomically(tmp_path, monkeypatch):
    from dtrain.engine import checkpoint

    for batches, finite in [(10, True), (20, True), (30, False), (40, False)]:
        _fake_checkpoint(tmp_path, batches, finite)
    (tmp_path / ".deleting-5").mkdir()  # a crash's leftovers
    (tmp_path / ".tmp-7").mkdir()
    checkpoint._prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["20", "30", "40"]

    # Killed in the middle of deleting a checkpoint's files: it was renamed out of sight first.
    real_rmtree = checkpoint.shutil.rmtree

    def crash(path, *args, **kwargs):
        if Path(path).exists():
            (Path(path) / "model.pt").unlink()  # half deleted...
            raise KeyboardInterrupt("killed while deleting")  # ...when the process dies
        real_rmtree(path, *args, **kwargs)

    _fake_checkpoint(tmp_path, 50)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint._prune(tmp_path, keep_last=2)
    visible = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert sorted(p.name for p in visible) == ["30", "40", "50"]  # 20 went; 30 and 40 hold no finite weights...
    assert all((p / "model.pt").exists() for p in visible)  # ...and nothing visible is half deleted
    monkeypatch.undo()
    _fake_checkpoint(tmp_path, 60)
    checkpoint._prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["50", "60"]  # leftovers cleaned on the next save


# ----------------------------------------------------------------------- 5. nothing a user has is destroyed

RESULTS = ("summary.json", "profile.json", "report.html", "metrics.jsonl")


@pytest.mark.slow
def test_a_failed_run_gets_one_advice_and_a_finished_one_is_never_rewritten(tmp_path, report_page):
    cfg = tiny_config(tmp_path, **{"hyperparameters.crash_at_batch": 2, "hyperparameters.crash_rank": 0,
                                   "max_length": {"batches": 8}, "resources.slots_per_trial": 1})
    run_dir = tmp_path / "r"
    failed = cli_in_process("run", str(cfg), "--run-dir", str(run_dir), "--quiet")
    assert failed.code == 1
    advice = f"no checkpoint was written, so there is nothing to resume: fix the cause, then start again with " \
             f"dtrain run --resume {run_dir} (the run's settings, from batch 0)"
    assert advice in failed.stderr, failed.stderr
    followed = cli_in_process("run", str(cfg), "--resume", str(run_dir), "--quiet",
                          "--set", "hyperparameters.crash_at_batch=null")  # the advice works
    assert followed.code == 0, followed.stderr

    before = {name: (run_dir / name).read_bytes() for name in RESULTS}
    again = cli_in_process("run", str(cfg), "--resume", str(run_dir))  # finished: says so, rewrites nothing
    assert again.code == 0 and again.stderr == "", again.stderr
    assert again.stdout.startswith(f"dtrain: run {run_dir} already finished: it trained 8 batches")
    assert len(again.stdout.splitlines()) == 1 and "--set max_length.batches=16" in again.stdout
    assert {name: (run_dir / name).read_bytes() for name in RESULTS} == before

    longer = cli_in_process("run", str(cfg), "--resume", str(run_dir), "--quiet", "--set", "max_length.batches=12")
    assert longer.code == 0, longer.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["batches"] == 12 and summary["resumed_at_batch"] == 8  # which part its figures cover
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["batches"] for r in records if r["kind"] == "validation"] == [8, 12]  # no duplicate, no stale


@pytest.mark.slow
def test_launch_names_the_scripts_exception_and_line_and_stops_cleanly(tmp_path, capfd):
    script = tmp_path / "train.py"
    script.write_text("import time\nimport dtrain\n\nctx = dtrain.init()\nif ctx.rank == 1:\n"
                      "    raise ValueError('bad shard')\nctx.barrier()\n")
    # The launcher in this process; its workers are new processes, whose output capfd reads.
    result = cli_in_process("launch", "--slots", "2", "--run-dir", str(tmp_path / "run"), str(script))
    workers = capfd.readouterr().err
    assert result.code == 1, workers + result.stderr
    assert result.stderr.splitlines()[-1] == (f"dtrain: error: worker rank 1 failed: ValueError: bad shard "
                                              f"(at {script}:6 in <module>)")
    assert "Connection reset" not in workers + result.stderr  # the peer's echo is not shown


# ------------------------------------------------------------------- 7. resume on another slot count


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 4)])
def test_resume_on_another_slot_count_matches_an_uninterrupted_run(tmp_path, reference_runs, before, after):
    cfg = tiny_config(tmp_path, **{"max_length": {"batches": 12}})
    run_dir = tmp_path / "r"
    first = cli_in_process("run", str(cfg), "--run-dir", str(run_dir), "--quiet", "--slots", str(before))
    assert first.code == 0, first.stderr
    resumed = cli_in_process("run", str(cfg), "--resume", str(run_dir), "--quiet", "--slots", str(after),
                         "--set", "max_length.batches=24")
    assert resumed.code == 0, resumed.stderr
    # The straight run on 1 slot: every slot count trains its weights (the invariant), and the suite trains that
    # one anyway (a 4-slot reference would be trained for this test alone).
    straight, after_resume = reference_runs.weights(1), final_weights(run_dir)
    for name in straight:
        torch.testing.assert_close(after_resume[name], straight[name], rtol=1e-5, atol=1e-5)
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert f"written by {before} slot(s), this job has {after}" in log
    assert "this model has no layer that draws from them (no dropout)" in log  # precisely what differs


def test_a_rank_that_never_started_is_named():
    """Seen in the suite: a forked rank stuck before its first line; the others timed out in startup."""
    from dtrain.launcher.culprit import Status, explain_timeout

    store = "DistStoreError: wait timeout after 30000ms, keys: /dtrain/attempt_0/0//cpu//0/3"
    now = 1000.0
    started = {r: Status(r, "h0", 10 + r, None, "startup", now - 31, now - 0.2, "127.0.0.1") for r in range(3)}
    rank, line = explain_timeout(0, store, now, {0, 1, 2}, started, world_size=4)
    assert rank == 3 and line == ("rank 3 never started: it published no status, so it was stuck or dead before "
                                  "its first step (if stuck, its log ends with its stack); rank 0 waited in startup "
                                  "and timed out after 30 s (resources.collective_timeout_seconds)")
    # Ranks on other nodes (world size unknown to this launcher): the waiter, as before.
    assert explain_timeout(0, store, now, {0, 1, 2}, started)[0] == 0


def test_a_forked_process_starts_its_own_status_clock_and_watchdog(monkeypatch):
    from dtrain.engine import watchdog
    from dtrain.engine.watchdog import STATUS

    read, write = os.pipe()
    STATUS.enter("train_batch", 5)
    STATUS.since -= 1000  # the launcher imported dtrain long ago
    # A watchdog in the forking process: its thread is not in the child, which must start its own.
    monkeypatch.setattr(watchdog, "_WATCHDOG", object())
    try:
        if (pid := os.fork()) == 0:
            try:
                os.write(write, f"{STATUS.phase} {STATUS.batch} {time.time() - STATUS.since < 5} "
                                f"{watchdog._WATCHDOG is None}".encode())
            finally:
                os._exit(0)
    finally:
        STATUS.__init__()  # this process's as it was at import
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 64) == b"startup None True True"
    assert watchdog._WATCHDOG is not None  # the parent's is untouched
    os.close(read)


def test_the_culprit_from_statuses_hung_frozen_or_a_lost_link():
    from dtrain.launcher.culprit import Status, explain_timeout, is_timeout

    gloo = "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation"
    assert is_timeout(gloo) and not is_timeout("TimeoutError: my data server is slow")
    now = 1000.0
    waiter = Status(0, "h0", 11, 20, "backward (gradient all-reduce)", now - 5, now, "10.0.0.1")
    hung = Status(1, "h0", 12, 20, "train_batch", now - 21, now - 0.2, "10.0.0.1")
    rank, line = explain_timeout(0, gloo, now, {0}, {0: waiter, 1: hung})
    assert rank == 1 and line.startswith("rank 1 on host h0 (10.0.0.1) (pid 12) stopped in train_batch at batch 20, "
                                         "21 s ago (alive, but not answering); rank 0 waited in backward (gradient "
                                         "all-reduce) at batch 20 and timed out after 5 s")
    frozen = Status(1, "h0", 12, 20, "train_batch", now - 21, now - 9, "10.0.0.1")
    assert "stopped answering in train_batch at batch 20, 21 s ago (no heartbeat for 9 s" in \
        explain_timeout(0, gloo, now, {0}, {0: waiter, 1: frozen})[1]
    # Same host name (containers, namespaces), other address, both inside the same collective: the link.
    peer = Status(1, "h0", 13, 20, "backward (gradient all-reduce)", now - 5, now - 0.1, "10.0.0.2")
    assert "the network between host h0 (10.0.0.1) and host h0 (10.0.0.2) is down or blocked" in \
        explain_timeout(0, gloo, now, {0}, {0: waiter, 1: peer})[1]
    # On CUDA the host runs ahead of its GPU: the phase is the host's, and the line says so.
    on_gpu = Status(1, "h0", 12, 20, "loading data", now - 21, now - 0.2, "10.0.0.1", gpu=True)
    assert "stopped in loading data at batch 20 (as the host saw it: its GPU may still have been in an earlier " \
           "collective), 21 s ago" in explain_timeout(0, gloo, now, {0}, {0: waiter, 1: on_gpu})[1]
