"""Agreeing on where to stop: every rank must stop after the same batch, or a checkpoint mixes steps.

A stop request reaches each rank on its own (:data:`dtrain.engine.watchdog.STOP`, set by a signal), at a
different moment. The ranks agree with one tiny all-reduce (two int64 on the CPU, MAX) that every rank
casts at the same *vote* batch: it carries the flag and each rank's proposal for the next vote's
distance, so votes come about every :data:`TARGET_SECONDS` of training whatever the step time, and the
agreed distance is the smallest proposal. The all-reduce is asynchronous: it is cast at one batch and
its result read one aggregation group later, where every rank stops if any asked to. A blocking one
would hold each rank until the slower one arrived (and until Gloo's threads got scheduled); in flight,
it costs the step loop only its launch. Between votes a rank reads no flag and syncs nothing. On GPU it
is a host-side collective (a Gloo group beside NCCL), which never waits for the device.

A training report's all-reduce (:class:`dtrain.engine.metrics.SumInFlight`, a SUM over the same ranks) also
carries each rank's flag and proposal (:meth:`StopVote.ride`); where it is read, the next vote moves to
the mean proposal's distance from the report (:meth:`StopVote.carried`). Where reports come more often
than every ~2 s, the trainer holds them back and sends them together with the last report before the
next vote's batch (:meth:`dtrain.engine.trainer.Trainer._report_training`): then no vote is cast, and the loop
launches one collective per ~2 s for reports and stopping together; when steps slow down, the next
report's proposals bring the votes back. Every in-flight all-reduce slows the step it overlaps (Gloo's
threads share the cores with the loop), so one collective fewer counts on small steps (docs/benchmarks.md,
"What the Trial's extra cost is made of"). A flag heard through a report stops every rank at the first
batch that ends an aggregation group from the one where the report was read, which is the same batch on
every rank.

A run on one rank casts no vote: it reads its own flag at every batch that ends an aggregation group and
stops there, so a signal lands within one group whatever the step time.

Votes fall on batches that end an aggregation group (where a checkpoint can be written). Strategies with
server ranks (the parameter server) do not vote: their servers do not run the step loop, so such a run
is stopped by the launcher's grace deadline and resumes from its last periodic checkpoint.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain import dist as ddist
from dtrain.engine.watchdog import STATUS, STOP

# Votes ~2 s apart: a stop lands within ~2 s of the signal (well inside Kubernetes' 30 s grace), and the loop
# launches one collective per ~2 s for stopping and reports together: each one in flight slows the step it
# overlaps, and across hosts each is a round of network latency (docs/benchmarks.md, "What the Trial's
# extra cost is made of").
TARGET_SECONDS = 2.0
MAX_INTERVAL = 100_000
# Written by the chief once the ranks stopped together and checkpointed: the launcher's proof of a clean stop.
STOPPED_FILE = "stopped.json"


class StopVote:
    """When to vote and the vote itself; identical on every rank that runs the step loop.

    :meth:`due` batches alternate between casting a vote and reading the one cast a group earlier;
    :meth:`settle` waits for a vote still in flight when the loop ends.
    """

    def __init__(self, enabled: bool, start_batch: int, group_size: int, backend: str) -> None:
        self.enabled = enabled
        self.k = max(1, group_size)
        self.world = ddist.world_size()
        self.next_at = start_batch + self.k if enabled else sys.maxsize
        self._last = (start_batch, time.monotonic())
        self._buf = torch.zeros(2, dtype=torch.int64)
        # The same memory as numpy: a vote's four reads and writes cost far less this way than through torch's
        # indexing; the all-reduce still runs on the tensor.
        self._values = self._buf.numpy()
        # The vote in flight: (its all-reduce, or None on one rank; the batch it was cast at).
        self._pending: tuple[Any, int] | None = None
        self._proposed = MAX_INTERVAL  # this rank's latest proposal (for a report at a vote's batch)
        self._heard = False  # a report said some rank asked to stop
        self.group = None
        if enabled and self.world > 1 and backend != "gloo":
            # A collective on every rank, in the same order: each builds the Trainer at the same point.
            self.group = dist.new_group(backend="gloo")

    def due(self, batch: int, sync: bool) -> bool:
        # Alone, a rank needs nobody's agreement: it stops at the first group end after the request.
        return sync and (batch >= self.next_at or (self.world == 1 and self.enabled and STOP.requested))

    def vote(self, batch: int) -> bool:
        """Collective, at a :meth:`due` batch: True when every rank must stop after ``batch`` (some rank was
        asked to stop). Casts a vote, or reads the one cast an aggregation group earlier; after
        :meth:`heard`, settles any vote in flight and says stop."""
        if self.world == 1:  # nothing to agree on, and nothing to cast: see due()
            self.next_at = sys.maxsize
            return STOP.requested
        if self._heard:
            self.settle()
            return True
        if self._pending is not None:
            return self._read(batch)
        self._cast(batch)
        return False

    def ride(self, batch: int) -> list[float]:
        """This rank's flag (1.0: asked to stop) and proposed distance to the next vote, to be summed over
        the ranks by a report's all-reduce cast at ``batch``; its result goes to :meth:`carried`, which
        places the next vote (none is cast meanwhile: this one is in flight)."""
        if self._pending is None and not self._heard:
            self.next_at = sys.maxsize
        return [float(STOP.requested), float(self._proposal(batch))]

    def carried(self, cast_at: int, flags: float, proposals: float, world: int) -> None:
        """A report cast at ``cast_at`` was read (at the same batch on every rank) with these sums of
        :meth:`ride`'s values: stop if any rank asked (:meth:`heard`), else put the next vote at the mean
        proposal's distance from the report, later or sooner (not while a vote is in flight: its read is
        already scheduled)."""
        if flags > 0:
            self.heard()
        elif self._pending is None and not self._heard:
            self.next_at = cast_at + self._rounded(int(proposals / max(1, world)))

    def heard(self) -> None:
        """Some rank asked to stop: every rank stops at its next :meth:`due` batch (the next end of an
        aggregation group), as every rank reads the report that said so at the same batch."""
        self._heard = True
        self.next_at = 0

    def _proposal(self, batch: int) -> int:
        """How many batches make ~TARGET_SECONDS at this rank's pace since the previous cast or report."""
        last_batch, last_time = self._last
        if batch == last_batch:  # a report and a vote cast at the same batch: no new time to go by
            return self._proposed
        now = time.monotonic()
        per_batch = (now - last_time) / (batch - last_batch)
        self._last = (batch, now)
        self._proposed = MAX_INTERVAL if per_batch <= 0 else max(1, min(MAX_INTERVAL, int(TARGET_SECONDS / per_batch)))
        return self._proposed

    def _rounded(self, interval: int) -> int:
        """A distance in whole aggregation groups (votes fall where groups end)."""
        return -(-interval // self.k) * self.k

    def _cast(self, batch: int) -> None:
        values = self._values
        values[1] = -self._proposal(batch)  # MAX of the negatives: the smallest proposal
        values[0] = int(STOP.requested)
        work = None
        if self.world > 1:
            work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending = (work, batch)
        self.next_at = batch + self.k  # the result is read where the next aggregation group ends

    def _read(self, batch: int) -> bool:
        cast_at = self._wait()
        values = self._values
        # The agreed distance counts from the cast; at least one group on from this read.
        self.next_at = max(batch + self.k, cast_at + self._rounded(-int(values[1])))
        return bool(values[0])

    def _wait(self) -> int:
        """Wait for the vote in flight (usually long done); the batch it was cast at."""
        work, cast_at = self._pending  # type: ignore[misc]
        self._pending = None
        if work is not None:
            with STATUS.during("stop vote"):
                work.wait()
        return cast_at

    def settle(self) -> None:
        """The loop ended with a vote in flight: complete it (every rank cast it) before other collectives."""
        if self._pending is not None:
            self._wait()


def write_stopped(logs: Path, batch: int) -> None:
    """Chief: record that every rank stopped after ``batch`` with a checkpoint there."""
    (logs / STOPPED_FILE).write_text(json.dumps({"batch": batch, "time": time.time()}))


def read_stopped(logs: Path, since: float | None = None) -> int | None:
    """The batch every rank last stopped at, if they did at or after ``since`` (a wall-clock time; an elastic
    job's earlier stop for a membership change is not this one)."""
    try:
        record = json.loads((logs / STOPPED_FILE).read_text())
        if since is not None and float(record.get("time", 0)) < since:
            return None
        return int(record["batch"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
