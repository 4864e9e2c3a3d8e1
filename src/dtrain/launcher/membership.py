"""The record of an elastic job's membership changes, kept in the shared run directory.

A change has a cause (a node joined, a node left on a signal, a node went away) and an effect (every rank
stopped at one batch with a checkpoint, or failed; the job continued from the latest checkpoint at a new
world size). The node that sees the cause first notes it (:func:`note_event`); the agent of the new
world's first node writes the change once the new world has trained its first step (:class:`ChangeRecorder`):
a ``membership`` record in ``metrics.jsonl``, a line in the run log (``logs/rank0.log``) and on its console.

Files under ``logs/elastic/`` (on the storage every node shares):

* ``pending.json``: the cause of the change under way (the first node to see it wins; removed once recorded);
* ``leaving/<node>.json``: a node asked to leave (its launcher got SIGTERM or SIGINT); the others read it
  to know how many nodes remain before they meet again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.engine import checkpoint, survivor
from dtrain.errors import CheckpointError
from dtrain.launcher.culprit import read_statuses

log = logging.getLogger("dtrain")

ELASTIC_DIR = "elastic"
PENDING = "pending.json"
LEAVING = "leaving"
# How each cause reads in a line: "a node joined", ...
CAUSES = {"join": "joined", "leave": "left", "lost": "went away"}


def elastic_dir(logs: Path) -> Path:
    return logs / ELASTIC_DIR


def _write_new(path: Path, record: dict[str, Any]) -> bool:
    """Write ``record`` to ``path`` unless it exists (the first writer wins); whether this one did."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    try:
        os.link(tmp, path)  # atomic, and fails where another node's record is already there
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def note_event(logs: Path, cause: str, node: str, when: float | None = None, **extra: Any) -> bool:
    """Note the cause of a membership change (``join``, ``leave``, ``lost``), unless one is pending already."""
    record = {"cause": cause, "node": node, "time": time.time() if when is None else when, **extra}
    return _write_new(elastic_dir(logs) / PENDING, record)


def pending_event(logs: Path) -> dict[str, Any] | None:
    return _read(elastic_dir(logs) / PENDING)


def clear(logs: Path) -> None:
    """A new job starts: no change of an earlier job is pending, no node of it is leaving."""
    folder = elastic_dir(logs)
    (folder / PENDING).unlink(missing_ok=True)
    for path in (folder / LEAVING).glob("*.json"):
        path.unlink(missing_ok=True)
    survivor.forget(logs)


def note_leaving(logs: Path, node: str, hosts_store: bool) -> None:
    """This node asked to leave (its launcher got a signal): the others count it before they meet again."""
    folder = elastic_dir(logs) / LEAVING
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{node}.tmp"
    tmp.write_text(json.dumps({"node": node, "time": time.time(), "hosts_store": hosts_store}))
    os.replace(tmp, folder / f"{node}.json")


def leaving_since(logs: Path, since: float) -> list[dict[str, Any]]:
    """The nodes that asked to leave at or after ``since`` (a wall-clock time)."""
    found = []
    for path in (elastic_dir(logs) / LEAVING).glob("*.json"):
        record = _read(path)
        if record is not None and float(record.get("time", 0)) >= since:
            found.append(record)
    return found


def last_batch(logs: Path) -> int | None:
    """The most batches any rank had trained by its last status (where a world that failed had got to)."""
    batches = [s.batch for s in read_statuses(logs).values() if s.batch is not None]
    return max(batches) if batches else None


@dataclass
class Change:
    """A change being recorded: the world now training, and the checkpoint it resumed from."""

    cause: dict[str, Any]
    batches: int
    old_world: int | None
    new_world: int
    global_rank0_pid: int
    recovered: dict[str, Any]  # a lost node: what the new world resumed from (see :func:`recovery`)


class ChangeRecorder:
    """Writes each membership change once the new world has trained its first step (on the new world's first
    node only: its agent sees global rank 0's status)."""

    def __init__(self, run_dir: Path, logs: Path, ckpt_root: Path) -> None:
        self.run_dir, self.logs, self.ckpt_root = run_dir, logs, ckpt_root
        self.current: Change | None = None

    def started(self, group_rank: int, new_world: int, rank0_pid: int | None, gone: list[str],
                nodes: list[str]) -> None:
        """A new world started here; if this node runs its global rank 0 and a change is pending, watch it.
        ``gone``: the nodes of the previous world missing from this one (as this node saw them); ``nodes``: the
        new world's nodes."""
        self.current = None
        cause = pending_event(self.logs)
        if group_rank != 0 or cause is None or rank0_pid is None:
            return
        if cause["cause"] == "lost" and gone:
            cause["node"] = ", ".join(gone)
        found = checkpoint.latest(self.ckpt_root)
        meta = _read(found / "metadata.json") if found is not None else None
        if meta is None:  # nothing trained yet: the nodes met before the first step, no change to record
            clear_pending(self.logs)
            return
        old = meta.get("world_size")
        if cause["cause"] == "join" and old == new_world:
            if cause["node"] not in nodes:
                # The joining node dropped out of the round before it trained (the others met again without
                # it): its join is still to come, in the world it gets into, and is recorded there.
                return
            clear_pending(self.logs)  # the joining node was there from the start
            return
        self.current = Change(cause, int(meta.get("batches", found.name)), old if isinstance(old, int) else None,
                              new_world, rank0_pid, recovery(self.logs, found) if cause["cause"] == "lost" else {})

    def poll(self) -> dict[str, Any] | None:
        """Once rank 0 has trained past the resumed batch: write the record; returns it (None: not yet)."""
        change = self.current
        if change is None:
            return None
        status = read_statuses(self.logs).get(0)
        if status is None or status.pid != change.global_rank0_pid or status.batch is None \
                or status.batch <= change.batches:
            return None
        self.current = None
        # The end of the first step at the new size: when the process's next batch began, as it said (its
        # status is published twice a second, often steps later); else from the batch it is at.
        first_step = (status.first_step_end if status.first_step_end is not None
                      else status.since if status.batch == change.batches + 1 else status.time)
        cause = change.cause
        lost = cause.get("last_batch")
        record = {"kind": "membership", "batches": change.batches, "cause": cause["cause"], "node": cause["node"],
                  "old_world_size": change.old_world, "new_world_size": change.new_world,
                  "seconds": round(max(0.0, first_step - float(cause["time"])), 3),
                  "lost_batches": max(0, int(lost) - change.batches) if lost is not None else 0,
                  "event_time": float(cause["time"]), "first_step_time": first_step, "time": time.time(),
                  **change.recovered}
        self._write(record)
        clear_pending(self.logs)
        survivor.forget(self.logs)  # every worker of the world that lost a node has exited: its votes are spent
        return record

    def _write(self, record: dict[str, Any]) -> None:
        line = describe(record)
        # Appends of one whole line: the chief worker appends to both files too (O_APPEND keeps lines whole).
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        with contextlib.suppress(OSError), (self.logs / "rank0.log").open("a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')},000 [launcher] INFO dtrain.elastic: {line}\n")
        print(f"dtrain: {line}", flush=True)


def recovery(logs: Path, resumed: Path) -> dict[str, Any]:
    """Where a world that lost a node continued from: ``recovered_from`` "survivors" (the state they held,
    :mod:`dtrain.engine.survivor`) or "checkpoint" (the latest periodic one), and why it fell back."""
    with contextlib.suppress(CheckpointError):
        if "survivor" in checkpoint.read_extra(resumed):
            return {"recovered_from": "survivors"}
    folder = survivor.newest_world(logs)
    votes = survivor.read_votes(folder) if folder is not None else {}
    reasons = [v.reason for v in sorted(votes.values(), key=lambda v: v.rank) if not v.saved and v.reason
               and not v.reason.startswith("kept")]
    why = reasons[0] if reasons else "no survivor saved its state"
    return {"recovered_from": "checkpoint", "fallback_reason": why}


def clear_pending(logs: Path) -> None:
    (elastic_dir(logs) / PENDING).unlink(missing_ok=True)


def describe(record: dict[str, Any]) -> str:
    """One line for a change: what happened, where, the sizes, the time it took and what it lost."""
    cause = CAUSES.get(record["cause"], record["cause"])
    old, new = record.get("old_world_size"), record["new_world_size"]
    sizes = f"{old if old is not None else '?'} -> {new} slot(s)"
    lost = record.get("lost_batches", 0)
    line = (f"membership change: {record['node']} {cause}; world size {sizes} at batch {record['batches']}; "
            f"{record['seconds']:.1f} s from the event to the first step at {new} slot(s); "
            f"{lost} batch(es) lost")
    if record.get("recovered_from") == "survivors":
        return line + "; continued from the state the survivors held"
    if record.get("recovered_from") == "checkpoint":
        return line + f"; fell back to the latest checkpoint ({record.get('fallback_reason', 'no survivor state')})"
    return line
