"""A user's unmodified script, profiled wherever it is launched: the session around the hooks.

:func:`start` puts :mod:`dtrain.profiling.script.hooks` in before the script runs (``dtrain launch`` through
:mod:`dtrain.engine.script_main`, ``python -m dtrain.profile``, or ``DTRAIN_PROFILE=DIR`` through the ``.pth``
file dtrain installs, in every process of the job, spawned children included) and exports ``DTRAIN_PROFILE``
so that processes the script starts itself are profiled into the same run directory.

The end (:func:`finish`), once per process, whichever comes first: the script's own ``destroy_process_group()``
(wrapped: the figures are taken while the group is alive), the interpreter's exit (``atexit``, and
multiprocessing's finalizers for ``mp.spawn``'s children, which leave by ``os._exit``), or a crash
(:mod:`dtrain.engine.script_main`). Each rank writes its own figures to ``ranks/rank-N.json`` first (a crash
leaves them); then sends them to rank 0 through the job's store (no collective: a rank that died cannot hang
it), and rank 0 waits for the others at most :data:`GATHER_SECONDS`, merges what arrived with any rank files
beside it, and writes ``profile.json``, ``summary.json`` and TensorBoard scalars. ``dtrain launch`` merges the
rank files again after the job (:func:`merge_rank_files`) where rank 0 could not.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

# The records' modules are imported at the end only: every process of a DTRAIN_PROFILE job loads this one when it
# imports torch (loader workers, launchers), and most of them never train.
from dtrain.profiling.script import hooks

ENV = "DTRAIN_PROFILE"
# Stop the script after this many optimizer steps, every rank after the same one (measuring a change: --verify).
STEPS_ENV = "DTRAIN_PROFILE_STEPS"
RANKS = "ranks"
SCRIPT_FILE = "script.json"
# How long rank 0 waits at the end for the other ranks' figures (a rank that died sends none).
GATHER_SECONDS = 30.0
_KEY = "rank"
# A rank file counts for this run where it was written after this run's first rank began, less this (the ranks
# of one job start within it).
STALE_SLACK_SECONDS = 60.0
# At the script's destroy_process_group(): how long rank 0 waits for every rank before the latency probe.
ARRIVAL_SECONDS = 5.0
_HERE, _GO = "here", "probe"
log = logging.getLogger("dtrain")


class Session:
    """One process's profiling of a script: where it writes, what ran, and the hooks' profiler."""

    def __init__(self, run_dir: Path, command: list[str], launcher: str) -> None:
        self.run_dir = run_dir
        self.command = command
        self.launcher = launcher
        self.cwd = os.getcwd()
        self.pid = os.getpid()
        self.began = time.perf_counter()
        self.profiler = hooks.ScriptProfiler()
        self.finished = False

    def info(self) -> dict[str, Any]:
        script = self.command[0] if self.command else ""
        return {"launcher": self.launcher, "command": self.command, "cwd": self.cwd,
                "script": str(Path(self.cwd, script).resolve()) if script else ""}


_SESSION: Session | None = None
_DESTROY: Any = None
_GROUP_DESTROYED = False  # the script destroyed its default group (release_before_teardown still has work)
_RELEASED = False  # release_before_teardown ran (script_main's end, then the session's atexit: once is enough)


def start(run_dir: Path, command: list[str] | None = None, launcher: str = "DTRAIN_PROFILE") -> Session | None:
    """Profile this process's script into ``run_dir`` (idempotent: a second call names the command and launcher).
    Never raises: profiling that cannot start says so in one line, and the script runs unprofiled."""
    global _SESSION
    try:
        run_dir = Path(run_dir).resolve()
        if _SESSION is not None and _SESSION.pid == os.getpid():
            if command is not None:
                _SESSION.command, _SESSION.launcher = list(command), launcher
            return _SESSION
        run_dir.mkdir(parents=True, exist_ok=True)
        os.environ[ENV] = str(run_dir)  # the script's own children profile into the same directory
        if "RANK" in os.environ:  # a file of an earlier run in this directory must not pass for this one's
            (run_dir / RANKS / f"rank-{os.environ['RANK']}.json").unlink(missing_ok=True)
        session = Session(run_dir, list(command if command is not None else sys.argv), launcher)
        steps = os.environ.get(STEPS_ENV, "")
        session.profiler.stop_after = int(steps) if steps.isdigit() and int(steps) > 0 else None
        session.profiler.on_stop = lambda: finish("destroy")
        from dtrain.profiling.script import overrides

        session.profiler.overrides = overrides.from_env()  # --verify's changes from outside, applied by the hooks
        hooks.install(session.profiler)
        _wrap_destroy()
        atexit.register(_at_exit)
        import multiprocessing.util as mp_util

        mp_util.Finalize(None, _at_exit, exitpriority=100)  # mp.spawn's children leave by os._exit
        _SESSION = session
        return session
    except Exception as exc:
        log.warning("dtrain: profiling could not start (%s: %s); the script runs unprofiled", type(exc).__name__, exc)
        return None


def session() -> Session | None:
    """This process's session (None: not profiling, or a forked child's inherited one)."""
    return _SESSION if _SESSION is not None and _SESSION.pid == os.getpid() else None


def _wrap_destroy() -> None:
    global _DESTROY
    if _DESTROY is not None:
        return
    from torch.distributed import distributed_c10d

    _DESTROY = distributed_c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        global _GROUP_DESTROYED
        if group is None:  # the default group: the job's end, while its store is still there
            finish("destroy")
            _GROUP_DESTROYED = True
        return _DESTROY(group)

    destroy_process_group.__doc__ = _DESTROY.__doc__
    distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def _at_exit() -> None:
    finish("exit")
    release_before_teardown()


def release_before_teardown() -> None:
    """Free what the script left unreachable (its DDP models, their process groups) while the interpreter is
    still whole. A Gloo worker thread that drops a finished collective during Python's teardown cannot take the
    GIL and aborts the process ("terminate called without an active exception", SIGABRT, pytorch#179291), so a
    run that trained ends as a failure; a process group freed now joins those threads first. Only in a process
    that used torch.distributed; once per process; never raises."""
    global _RELEASED
    if _RELEASED or not (dist.is_available() and (dist.is_initialized() or _GROUP_DESTROYED)):
        return
    _RELEASED = True
    from dtrain.dist import yield_to_pending_destructors

    yield_to_pending_destructors()  # (the collection may free the group: its threads must not need the GIL then)
    with contextlib.suppress(Exception):  # a __del__ of the script's: its own business, not the run's
        gc.collect()


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


def finish(reason: str) -> None:
    """Take this rank's figures and, on rank 0, write the run's records (once per process; never raises).
    ``reason``: "destroy" (the group is alive: gather through its store), "exit", or "crash" (no waiting)."""
    current = session()
    if current is None or current.finished:
        return
    current.finished = True
    prof = current.profiler
    hooks.stop()
    if prof.timer is None and not prof.ddps:  # this process trained nothing (a launcher, a loader worker)
        return
    try:
        from dtrain.profiling.script.merge import rank_payload

        rank, world = _rank_world()
        payload = rank_payload(prof, rank, world, time.perf_counter() - current.began)
        if reason == "destroy" and world > 1:
            payload["latency_seconds"] = _latency_when_all_here(rank, world)
        _write_json(current.run_dir / RANKS / f"rank-{rank}.json", payload)
        gathered = {rank: payload}
        if reason != "crash" and world > 1 and dist.is_initialized():
            gathered.update(_through_store(payload, rank, world))
        if rank == 0:
            write_records(current.run_dir, current.info(), gathered, complete=reason != "crash")
    except Exception as exc:
        log.warning("dtrain: the profile could not be written (%s: %s)", type(exc).__name__, exc)


def _store() -> Any:
    """The job's store, its keys under this attempt's prefix (a restarted job's agent keeps the last attempt's)."""
    return dist.PrefixStore(f"dtrain_profile/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
                            dist.distributed_c10d._get_default_store())


def _latency_when_all_here(rank: int, world: int) -> float:
    """The one-float all-reduce's latency (what the doctor prices each exchange's messages by), probed only where
    every rank has reached its ``destroy_process_group()``: rank 0 waits for them through the store at most
    :data:`ARRIVAL_SECONDS` and decides for all (a rank that never comes cannot leave the others in a
    collective); 0 where not probed."""
    from dtrain.profiling.figures import latency_probe

    store = _store()
    store.set(f"{_HERE}{rank}", "1")
    if rank == 0:
        try:
            store.wait([f"{_HERE}{r}" for r in range(1, world)], timedelta(seconds=ARRIVAL_SECONDS))
            go = "1"
        except Exception:  # someone is not here: no collective
            go = "0"
        store.set(_GO, go)
    else:
        try:
            store.wait([_GO], timedelta(seconds=3 * ARRIVAL_SECONDS))
            go = store.get(_GO).decode()
        except Exception:
            go = "0"
    return latency_probe() if go == "1" else 0.0


def _through_store(payload: dict[str, Any], rank: int, world: int) -> dict[int, dict[str, Any]]:
    """Rank 0 receives the others' payloads through the job's store (at most GATHER_SECONDS in all); the others
    send theirs."""
    store = _store()
    if rank != 0:
        store.set(f"{_KEY}{rank}", json.dumps(payload))
        return {}
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + GATHER_SECONDS
    for other in range(1, world):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            store.wait([f"{_KEY}{other}"], timedelta(seconds=left))
            got[other] = json.loads(store.get(f"{_KEY}{other}"))
        except Exception:  # a rank that never sent (it died): the record says which
            continue
    return got


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _rank_files(run_dir: Path) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for path in sorted((run_dir / RANKS).glob("rank-*.json")):
        try:
            payload = json.loads(path.read_text())
            found[int(payload["rank"])] = payload
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def write_records(run_dir: Path, info: dict[str, Any], gathered: dict[int, dict[str, Any]],
                  complete: bool) -> bool:
    """``profile.json``, ``summary.json``, ``script.json`` and TensorBoard scalars from the ranks' payloads
    (``gathered``, and rank files beside them for ranks not gathered); True where a profile was written."""
    from dtrain.profiling.record import FILE_NAME as PROFILE_FILE
    from dtrain.profiling.record import write_profile
    from dtrain.profiling.runsummary import FILE_NAME as SUMMARY_FILE
    from dtrain.profiling.runsummary import write_summary
    from dtrain.profiling.script.merge import build_records

    files = _rank_files(run_dir)
    if gathered:  # files of an earlier run in this directory (another world, or ended before this one began)
        mine = gathered[min(gathered)]
        began = mine.get("began_at", 0.0) - STALE_SLACK_SECONDS
        files = {r: p for r, p in files.items()
                 if p.get("world") == mine.get("world") and p.get("ended_at", 0.0) >= began}
    payloads = dict(sorted({**files, **gathered}.items()))
    record, summary, script = build_records(list(payloads.values()), info, complete)
    _write_json(run_dir / SCRIPT_FILE, script.model_dump())
    if record is None or summary is None:
        print(f"dtrain: no training step seen in {info['script']} (an optimizer.step() after a backward): "
              f"nothing profiled; {run_dir / SCRIPT_FILE} says what was seen", file=sys.stderr)
        return False
    write_profile(run_dir / PROFILE_FILE, record)
    write_summary(run_dir / SUMMARY_FILE, summary)
    _tensorboard(run_dir, payloads[min(payloads)])
    print(f"dtrain: profiled {summary.steps} steps on {record.slots} rank(s) into {run_dir}; "
          f"dtrain doctor {run_dir}", file=sys.stderr)
    return True


def _tensorboard(run_dir: Path, payload: dict[str, Any]) -> None:
    """The first rank's phase means per window of steps, in milliseconds (tags ``time_ms/PHASE``, as a Trial's)."""
    windows = payload.get("phase_windows") or []
    if not windows:
        return
    from dtrain.engine.metrics import EventFile

    events = EventFile(run_dir / "tensorboard")
    try:
        for step, means in windows:
            events.scalars({f"time_ms/{k}": 1000 * v for k, v in means.items()}, int(step))
    finally:
        events.close()


def merge_rank_files(run_dir: Path, info: dict[str, Any]) -> bool:
    """After the job (``dtrain launch``): rebuild the records from every rank's file where rank 0's record is
    missing or lacks a rank that left a file (a crash, a rank that was late). True where a profile exists."""
    from dtrain.profiling.record import FILE_NAME as PROFILE_FILE

    files = _rank_files(run_dir)
    if not files:
        return (run_dir / PROFILE_FILE).is_file()
    try:
        reported = set(json.loads((run_dir / SCRIPT_FILE).read_text()).get("ranks_reported", []))
    except (OSError, ValueError):
        reported = set()
    if (run_dir / PROFILE_FILE).is_file() and set(files) <= reported:
        return True
    return write_records(run_dir, info, {}, complete=False)
