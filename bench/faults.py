#!/usr/bin/env python3
"""Fault-injection campaign: what a cluster inflicts on a run, and what dtrain makes of it (not part of ``make test``).

Every trial is a real ``dtrain run`` (or ``dtrain launch``) of the tiny trial of tests/trials/tiny.py on 2
slots, Gloo, started in a session of its own and killed whole afterwards. For each fault it records the
exit code, the seconds from the fault to the exit, whether the one-line message says what it should,
and, where the run can be resumed, whether the resumed run's final weights are bit-identical to an
uninterrupted run's (dropout on, so the random streams must be restored too).

    .venv/bin/python bench/faults.py --trials 3                 # every fault, 3 trials each
    .venv/bin/python bench/faults.py --faults hang,freeze --trials 10 --timeout 20

Prints a Markdown table (docs/reliability.md holds one measured here). About 30 s per trial on 2 busy cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dtrain.launcher import supervise

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import tiny_config  # noqa: E402  (the trial with planted faults lives with the tests)

BATCHES = 60
FAULT_AT = 20  # the batch the fault hits (0-based, as train_batch sees it)
BASE = {"hyperparameters.dropout": 0.1, "max_length": {"batches": BATCHES}, "min_checkpoint_period": {"batches": 10},
        "scheduling_unit": 10, "hyperparameters.sleep_rank": 1, "hyperparameters.sleep_seconds": 0.02}


@dataclass
class Trial:
    code: int | None = None
    seconds: float | None = None  # from the fault to the exit (or to the last worker gone)
    message_ok: bool = False
    identical: bool | None = None  # None: not applicable
    note: str = ""


@dataclass
class Fault:
    name: str
    what: str
    expected_code: int
    run: Callable[[], Trial]
    trials: list[Trial] = field(default_factory=list)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dtrain.cli", *args], cwd=ROOT, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _statuses(run_dir: Path) -> dict[int, dict]:
    found = {}
    for path in (run_dir / "logs").glob("status.rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            found[record["rank"]] = record
    return found


def _wait_batch(proc: subprocess.Popen, run_dir: Path, batch: int, timeout: float = 180) -> dict[int, dict]:
    """Every rank's status once all reached ``batch`` (or once the run ended: a fault may end it first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _statuses(run_dir)
        if proc.poll() is not None or (len(found) == 2 and all((s["batch"] or 0) >= batch for s in found.values())):
            if len(found) < 2:
                raise RuntimeError(f"the run ended before every rank published a status: {proc.communicate()}")
            return found
        time.sleep(0.05)
    raise RuntimeError(f"run never reached batch {batch}")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _finish(proc: subprocess.Popen, workers: list[int], timeout: float = 300) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return proc.returncode, err


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return torch.load(run_dir / "checkpoints" / latest / "model.pt", weights_only=True)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Campaign:
    def __init__(self, work: Path, timeout: float) -> None:
        self.work, self.timeout = work, timeout
        self.count = 0
        self.reference: dict[str, torch.Tensor] | None = None

    def config(self, **extra: object) -> tuple[Path, Path]:
        self.count += 1
        folder = self.work / f"t{self.count}"
        folder.mkdir()
        cfg = tiny_config(folder, **{**BASE, "resources.collective_timeout_seconds": self.timeout, **extra})
        return cfg, folder / "r"

    def straight(self) -> dict[str, torch.Tensor]:
        if self.reference is None:
            cfg, run_dir = self.config(**{"hyperparameters.sleep_seconds": 0})
            code, err = _finish(_start("run", str(cfg), "--run-dir", str(run_dir), "--quiet"), [])
            assert code == 0, err
            self.reference = _weights(run_dir)
        return self.reference

    def resume_identical(self, cfg: Path, run_dir: Path) -> bool:
        code, _ = _finish(_start("run", str(cfg), "--resume", str(run_dir), "--quiet", "--set",
                                 "hyperparameters.sleep_seconds=0", "--set", "hyperparameters.crash_at_batch=null"), [])
        return code == 0 and _same(_weights(run_dir), self.straight())

    # ------------------------------------------------------------------- faults inside a rank (planted)
    def planted(self, knobs: dict, expect: str, pre_sleep: float = 0.0) -> Trial:
        cfg, run_dir = self.config(**{f"hyperparameters.{k}": v for k, v in knobs.items()})
        proc = _start("run", str(cfg), "--run-dir", str(run_dir), "--quiet")
        statuses = _wait_batch(proc, run_dir, FAULT_AT)
        code, err = _finish(proc, [s["pid"] for s in statuses.values()])
        ended = time.time()
        last = _statuses(run_dir).get(1, {})
        # The fault struck when rank 1 entered train_batch at FAULT_AT (after a planted pre-sleep).
        fault_at = last.get("since", ended) + pre_sleep if last.get("batch") == FAULT_AT else None
        host, pid = statuses[1]["host"], statuses[1]["pid"]
        ok = expect.format(host=host, pid=pid, batch=FAULT_AT) in err and "Traceback" not in err
        return Trial(code, ended - fault_at if fault_at else None, ok, note=err.strip().splitlines()[0][:200])

    def exception(self) -> Trial:
        return self.planted({"crash_at_batch": FAULT_AT}, "worker rank 1 failed: RuntimeError: planted failure at "
                            "batch {batch}")

    def hang(self) -> Trial:
        return self.planted({"sleep_at_batch": FAULT_AT, "sleep_seconds": 600},
                            "rank 1 on host {host} (pid {pid}) stopped in train_batch at batch {batch}")

    def freeze(self) -> Trial:
        return self.planted({"sleep_at_batch": FAULT_AT, "sleep_seconds": 1.0, "freeze_at_batch": FAULT_AT},
                            "rank 1 on host {host} (pid {pid}) stopped answering in train_batch at batch {batch}",
                            pre_sleep=1.0)

    def kill_worker(self) -> Trial:
        return self.planted({"sleep_at_batch": FAULT_AT, "sleep_seconds": 1.0, "kill_at_batch": FAULT_AT},
                            "worker rank 1 failed: killed by signal SIGKILL (host {host}, pid {pid}, in train_batch "
                            "at batch {batch})", pre_sleep=1.0)

    def nan(self) -> Trial:
        trial = self.planted({"nan_at_batch": FAULT_AT}, "NonFiniteError: the loss became non-finite (nan or inf) on "
                             "rank 1 at batch {batch}")
        run_dir = self.work / f"t{self.count}" / "r"
        finite = all(json.loads((p / "metadata.json").read_text()).get("finite")
                     for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
        trial.message_ok = trial.message_ok and finite
        return trial

    # ------------------------------------------------------------------- faults from outside (signals)
    def signalled(self, sig: int, target: str, expect: str | None) -> Trial:
        cfg, run_dir = self.config()
        proc = _start("run", str(cfg), "--run-dir", str(run_dir), "--quiet")
        statuses = _wait_batch(proc, run_dir, FAULT_AT)
        workers = [s["pid"] for s in statuses.values()]
        struck = time.monotonic()
        (os.killpg if target == "group" else os.kill)(proc.pid, sig)
        if sig == signal.SIGKILL:  # nobody left to report: time until the last worker is gone
            while any(_alive(p) for p in workers) and time.monotonic() - struck < 60:
                time.sleep(0.02)
            seconds = time.monotonic() - struck
            code, err = _finish(proc, workers)
            ok = not any(_alive(p) for p in workers)
        else:
            code, err = _finish(proc, workers)
            seconds = time.monotonic() - struck
            ok = expect is not None and expect in err and len(err.strip().splitlines()) == 1
        return Trial(code, seconds, ok, self.resume_identical(cfg, run_dir), note=err.strip()[:200])

    def kill_during_checkpoints(self) -> Trial:
        """SIGKILL at a random moment of a run that checkpoints (and prunes) every batch."""
        cfg, run_dir = self.config(**{"min_checkpoint_period": {"batches": 1},
                                      "checkpoint_storage.save_trial_latest": 1})
        proc = _start("run", str(cfg), "--run-dir", str(run_dir), "--quiet")
        statuses = _wait_batch(proc, run_dir, 5)
        time.sleep(random.uniform(0, 1.0))
        os.killpg(proc.pid, signal.SIGKILL)
        code, _ = _finish(proc, [s["pid"] for s in statuses.values()])
        from dtrain.engine import checkpoint

        root = run_dir / "checkpoints"
        visible = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        try:
            checkpoint.verify(checkpoint.latest(root))  # type: ignore[arg-type]
            complete = all((p / "metadata.json").is_file() for p in visible)
        except Exception:  # any failure to verify is the finding
            complete = False
        return Trial(code, None, complete, self.resume_identical(cfg, run_dir))

    def resume_finished(self) -> Trial:
        cfg, run_dir = self.config(**{"hyperparameters.sleep_seconds": 0})
        _finish(_start("run", str(cfg), "--run-dir", str(run_dir), "--quiet"), [])
        names = ("summary.json", "profile.json", "report.html", "metrics.jsonl")
        before = {n: (run_dir / n).read_bytes() for n in names}
        start = time.monotonic()
        code, _ = _finish(_start("run", str(cfg), "--resume", str(run_dir), "--quiet"), [])
        untouched = {n: (run_dir / n).read_bytes() for n in names} == before
        return Trial(code, time.monotonic() - start, untouched, _same(_weights(run_dir), self.straight()))

    def launch_exception(self) -> Trial:
        self.count += 1
        script = self.work / f"t{self.count}.py"
        script.write_text("import dtrain\n\nctx = dtrain.init()\nif ctx.rank == 1:\n    raise KeyError('shard 7')\n"
                          "ctx.barrier()\n")
        start = time.monotonic()
        code, err = _finish(_start("launch", "--slots", "2", str(script)), [])
        expected = f"dtrain: error: worker rank 1 failed: KeyError: 'shard 7' (at {script}:5 in <module>)"
        ok = err.strip().splitlines()[-1] == expected
        return Trial(code, time.monotonic() - start, ok)


    def launch_sigint(self) -> Trial:
        """Ctrl-C of ``dtrain launch`` running a user's loop (no clean-stop protocol: SIGTERM, then SIGKILL)."""
        self.count += 1
        script = self.work / f"t{self.count}.py"
        marker = self.work / f"t{self.count}.started"
        script.write_text("import time\nfrom pathlib import Path\nimport dtrain\n\nctx = dtrain.init()\n"
                          f"Path({str(marker)!r}).write_text('x')\nfor _ in range(100000):\n    ctx.barrier()\n"
                          "    time.sleep(0.01)\n")
        proc = _start("launch", "--slots", "2", str(script))
        while not marker.exists() and proc.poll() is None:
            time.sleep(0.05)
        workers = supervise.children(proc.pid)
        struck = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code, err = _finish(proc, workers)
        seconds = time.monotonic() - struck
        ok = err.strip() == "dtrain: launch stopped by SIGINT" and not any(_alive(p) for p in workers)
        return Trial(code, seconds, ok)


    def link_cut(self) -> Trial:
        """Two test hosts (network namespaces, root), one slot each; the link of host 1 goes down mid-run."""
        sys.path.insert(0, str(ROOT / "scripts"))
        import testhosts

        reason = testhosts.unavailable_reason()
        if reason is not None:
            return Trial(note=f"skipped: {reason}")
        cfg, run_dir = self.config(**{"resources.join_timeout_seconds": 60})
        with testhosts.TestHosts(2, pin_cpus=True) as hosts:
            argv = [sys.executable, "-m", "dtrain.cli", "run", str(cfg), "--run-dir", str(run_dir), "--quiet",
                    "--nnodes", "2", "--master", f"{hosts.hostname(0)}:29500", "--node-rank"]
            procs = [hosts.popen(i, [*argv, str(i)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for i in range(2)]
            _wait_batch(procs[0], run_dir, FAULT_AT)
            struck = time.monotonic()
            subprocess.run(["ip", "-n", hosts.switch, "link", "set", "p1", "down"], check=True, timeout=30)
            code, err = _finish(procs[0], [], timeout=120)
            seconds = time.monotonic() - struck
            hosts.destroy()
        lines = err.strip().splitlines()
        ok = bool(lines) and ("the network between" in lines[0] or "stopped answering" in lines[0]) and \
            hosts.hosts[1].address in lines[0]
        return Trial(code, seconds, ok, note=lines[0][:200] if lines else "")


def faults(c: Campaign) -> list[Fault]:
    resume = "by {sig}; resume with: dtrain run "
    return [
        Fault("exception", "rank 1 raises at batch 20", 1, lambda: c.exception()),
        Fault("hang", "rank 1 sleeps at batch 20", 1, lambda: c.hang()),
        Fault("freeze", "rank 1 SIGSTOPped at batch 20", 1, lambda: c.freeze()),
        Fault("kill-worker", "rank 1 SIGKILLed at batch 20", 1, lambda: c.kill_worker()),
        Fault("link-cut", "2 test hosts, host 1's link down at batch 20", 1, lambda: c.link_cut()),
        Fault("nan", "rank 1's loss is NaN at batch 20", 1, lambda: c.nan()),
        Fault("sigterm", "SIGTERM to dtrain (preemption)", 143,
              lambda: c.signalled(signal.SIGTERM, "launcher", resume.format(sig="SIGTERM"))),
        Fault("sigint", "Ctrl-C (SIGINT to dtrain)", 130,
              lambda: c.signalled(signal.SIGINT, "launcher", resume.format(sig="SIGINT"))),
        Fault("kill-launcher", "SIGKILL of dtrain (OOM killer)", -9,
              lambda: c.signalled(signal.SIGKILL, "launcher", None)),
        Fault("kill-group", "SIGKILL of dtrain's process group", -9,
              lambda: c.signalled(signal.SIGKILL, "group", None)),
        Fault("kill-checkpointing", "SIGKILL while checkpointing/pruning every batch", -9,
              lambda: c.kill_during_checkpoints()),
        Fault("resume-finished", "--resume of a finished run (s: whole command)", 0, lambda: c.resume_finished()),
        Fault("launch-exception", "dtrain launch: script raises on rank 1 (s: whole command)", 1,
              lambda: c.launch_exception()),
        Fault("launch-sigint", "Ctrl-C of dtrain launch (own loop)", 130, lambda: c.launch_sigint()),
    ]


def _seconds(trials: list[Trial]) -> str:
    values = [t.seconds for t in trials if t.seconds is not None]
    if not values:
        return "-"
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def table(done: list[Fault], timeout: float) -> str:
    lines = [f"collective_timeout_seconds {timeout:g}; seconds from the fault to the exit (min / median / max)", "",
             "| fault | what | trials | expected exit | exits | seconds to exit | message right | bit-identical |",
             "|---|---|---|---|---|---|---|---|"]
    for f in done:
        codes = sorted({t.code for t in f.trials}, key=str)
        identical = [t.identical for t in f.trials if t.identical is not None]
        exits = f"{sum(t.code == f.expected_code for t in f.trials)}/{len(f.trials)} ({', '.join(map(str, codes))})"
        lines.append(f"| {f.name} | {f.what} | {len(f.trials)} | {f.expected_code} | {exits}"
                     f" | {_seconds(f.trials)} | {sum(t.message_ok for t in f.trials)}/{len(f.trials)} | "
                     f"{f'{sum(identical)}/{len(identical)}' if identical else '-'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--faults", help="comma-separated subset (default: all)")
    parser.add_argument("--timeout", type=float, default=5.0, help="resources.collective_timeout_seconds")
    parser.add_argument("--json", type=Path, help="also write every trial here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dtrain-faults-") as tmp:
        campaign = Campaign(Path(tmp), args.timeout)
        chosen = [f for f in faults(campaign) if not args.faults or f.name in args.faults.split(",")]
        for fault in chosen:
            for i in range(args.trials):
                try:
                    trial = fault.run()
                except Exception as exc:  # a campaign records failures, it does not stop
                    trial = Trial(note=f"campaign error: {exc}")
                fault.trials.append(trial)
                seconds = trial.seconds and round(trial.seconds, 1)
                print(f"{fault.name} #{i + 1}: exit {trial.code}, {seconds} s, message "
                      f"{'ok' if trial.message_ok else 'WRONG'}, identical {trial.identical}  {trial.note[:150]}",
                      file=sys.stderr, flush=True)
        print(table(chosen, args.timeout))
        if args.json:
            args.json.write_text(json.dumps({f.name: [t.__dict__ for t in f.trials] for f in chosen}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
