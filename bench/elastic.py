#!/usr/bin/env python3
"""Elastic membership timings: a node joins, leaves (SIGTERM) and is killed (SIGKILL) while a job trains.

Two nodes of one ``dtrain run --nnodes 1:2 --rdzv-backend c10d`` job (the tiny trial of tests/trials/tiny.py,
1 slot per node, one shared run directory), either both on this machine (``--where local``: loopback) or
on two network-namespace test hosts (``--where hosts``, root; scripts/testhosts.py). Per trial:

* **join + leave**: node A trains alone and holds at batch 8; node B starts with the same command and joins;
  once both ranks train, B gets SIGTERM and leaves; A ends the run alone.
* **crash**: as above up to the join; once both ranks trained past the first periodic checkpoint, B's
  launcher is SIGKILLed (its workers die with it); A saves the state it holds (the last step both finished)
  and continues alone from it (``recovered_from: survivors``), else from the latest checkpoint.

For each change: seconds from the event (B's agent starting to meet the job; the SIGTERM; the SIGKILL, by
this script's clock) to the end of the first step at the new world size, and the batches lost (trained,
then trained again after resuming), from the ``membership`` records of the run's metrics.jsonl.

    .venv/bin/python bench/elastic.py [--where local|hosts|both] [--trials 5] [--last-call 5] [--json out.json]

Prints a Markdown table. About a minute per trial and place on a 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
import testhosts  # noqa: E402
from helpers import free_port, tiny_config  # noqa: E402  (the trial with planted holds lives with the tests)

from dtrain.engine.metrics import membership_records  # noqa: E402
from dtrain.launcher.culprit import read_statuses  # noqa: E402

TOTAL = 400
HOLD_AT = 8


class Nodes:
    """Where the two nodes run: here (loopback), or on namespace test hosts."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.hosts = testhosts.TestHosts(2, pin_cpus=True) if where == "hosts" else None
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Nodes:
        if self.hosts is not None:
            self.hosts.create()
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self.hosts is not None:
            self.hosts.destroy()

    def master(self, port: int) -> str:
        return f"{self.hosts.hosts[0].address}:{port}" if self.hosts is not None else f"127.0.0.1:{port}"

    def start(self, i: int, argv: list[str], out: Path) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with out.with_suffix(".out").open("w") as stdout, out.with_suffix(".err").open("w") as stderr:
            if self.hosts is not None:
                proc = self.hosts.popen(i, argv, cwd=ROOT, env=env, stdout=stdout, stderr=stderr)
            else:
                proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
        self.procs.append(proc)
        return proc


def _wait(what: str, ready: Callable[[], object], procs: list[subprocess.Popen], timeout: float = 120) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = ready()
        if found:
            return found
        if any(p.poll() not in (None, 0, 143, -signal.SIGKILL) for p in procs):  # B: left, or killed
            raise RuntimeError(f"{what}: a node failed ({[p.returncode for p in procs]})")
        time.sleep(0.05)
    raise RuntimeError(f"{what}: not within {timeout:.0f}s")


def _holding(run: Path) -> bool:
    status = read_statuses(run / "logs").get(0)
    return status is not None and status.batch == HOLD_AT


def _training(run: Path, world: int, past: int) -> bool:
    found = read_statuses(run / "logs")
    return set(found) >= set(range(world)) and all((found[r].batch or 0) > past for r in range(world))


def trial(where: str, crash: bool, tmp: Path, last_call: int) -> list[dict]:
    """One job: B joins A, then leaves (or is killed); the membership records, with the measured seconds."""
    (tmp / "hold").write_text("hold")
    cfg = tiny_config(tmp, **{"resources.join_timeout_seconds": 60, "resources.collective_timeout_seconds": 30,
                              "resources.rendezvous_last_call_seconds": last_call,
                              "max_length": {"batches": TOTAL}, "min_checkpoint_period": {"batches": 40},
                              "hyperparameters.sleep_rank": 0, "hyperparameters.sleep_seconds": 0.03,
                              "hyperparameters.hold_at_batch": HOLD_AT, "hyperparameters.hold_file": str(tmp / "hold")})
    run = tmp / "r"
    with Nodes(where) as nodes:
        argv = [sys.executable, "-m", "dtrain.cli", "run", str(cfg), "--run-dir", str(run), "--quiet", "--nnodes",
                "1:2", "--rdzv-backend", "c10d", "--master", nodes.master(free_port())]
        a = nodes.start(0, argv, tmp / "a")
        _wait("A holds", lambda: _holding(run), nodes.procs)
        b = nodes.start(1, argv, tmp / "b")
        _wait("B joined", lambda: membership_records(run), nodes.procs)
        (tmp / "hold").unlink()
        _wait("both train", lambda: _training(run, 2, 44 if crash else 12), nodes.procs)
        event = time.time()
        if crash:
            os.killpg(b.pid, signal.SIGKILL)
        else:
            b.send_signal(signal.SIGTERM)
        records = _wait("the change after the join", lambda: membership_records(run)[1:], nodes.procs)
        records = membership_records(run)
        records[1]["event_time"] = event  # this script's clock: from the signal or the kill itself
        a.wait(timeout=180)
        for record in records:
            record["measured_seconds"] = record["first_step_time"] - record["event_time"]
            record["where"] = where
        return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--where", choices=["local", "hosts", "both"], default="local")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--last-call", type=int, default=5, help="resources.rendezvous_last_call_seconds")
    args = parser.parse_args()
    places = ["local", "hosts"] if args.where == "both" else [args.where]
    if "hosts" in places and testhosts.unavailable_reason() is not None:
        print(f"skipping test hosts: {testhosts.unavailable_reason()}", file=sys.stderr)
        places.remove("hosts")
    rows: list[dict] = []
    for where in places:
        for _ in range(args.trials):
            for crash in (False, True):
                with tempfile.TemporaryDirectory(prefix="dtrain-elastic-") as tmp:
                    found = trial(where, crash, Path(tmp), args.last_call)
                rows.extend(found if not crash else found[1:])  # the crash job's join repeats the first's
    table: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        table.setdefault((row["where"], row["cause"]), []).append(row)
    print("| where | event | world | event -> first step at new size (s): median [min, max] | batches lost: "
          "median [min, max] | continued from |")
    print("|---|---|---|---|---|---|")
    for (where, cause), found in table.items():
        secs = [r["measured_seconds"] for r in found]
        lost = [r["lost_batches"] for r in found]
        world = f"{found[0]['old_world_size']} -> {found[0]['new_world_size']}"
        sources = sorted({str(r.get("recovered_from", "agreed checkpoint")) for r in found})
        print(f"| {where} | {cause} | {world} | {statistics.median(secs):.1f} [{min(secs):.1f}, {max(secs):.1f}] "
              f"| {statistics.median(lost):g} [{min(lost)}, {max(lost)}] | {', '.join(sources)} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
