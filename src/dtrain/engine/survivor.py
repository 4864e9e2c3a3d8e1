"""A lost peer's survivors keep the replica: one step lost, not a checkpoint period.

When a collective fails only because a peer went away (its connection closed: a node killed outright), every
surviving rank of a synchronous data-parallel job still holds the state after the last step whose gradient
exchange finished: the replicas are identical up to it. Before the agent restarts the workers, the survivors
save that state as a crash-proof checkpoint (the usual atomic commit), marked ``extra["survivor"]``, and the
next world resumes from it at its own size (the resume-on-another-slot-count path).

What "complete" means here: the model and optimizer as of the end of the last exchanging batch, and the loop
(data position, schedulers, callbacks) at that same batch. A failure inside an exchange leaves the update
unapplied (DDP raises in backward, before ``step``; an explicit exchange raises before it updates), so the
state is the previous exchange's; accumulated gradients are never saved. A rank that cannot be sure (the
optimizer stepped more often than the schedule says, callbacks ran past the last exchange, the strategy keeps
part of the state on each rank) saves nothing: the job falls back to its latest checkpoint.

Agreement, through files in the shared run directory (``logs/elastic/survivors/<world>/``): each survivor
writes its vote (the batch it holds, or why none); the first to claim the world saves, the others compare
their batch with the claim. A survivor that disagrees marks it, and whichever of the two sees the other's
mark or checkpoint last withdraws the survivor checkpoint (the latest one before it is used instead).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from dtrain import dist
from dtrain.config.schema import ExperimentConfig
from dtrain.engine import checkpoint
from dtrain.engine.callbacks import Callbacks
from dtrain.engine.context import TrialContext
from dtrain.engine.failures import is_secondary
from dtrain.engine.metrics import MeanAccumulator
from dtrain.engine.watchdog import STATUS

log = logging.getLogger(__name__)

# Set by the elastic agent (dtrain.launcher.elastic) for its workers: a job of fixed size stops on a lost
# rank and resumes from its latest checkpoint, as before.
ENABLE_ENV = "DTRAIN_SURVIVORS_KEEP_STATE"
SURVIVORS = "elastic/survivors"  # under the run's logs/
VOTE = "rank{rank}.json"
CLAIM = "claim.json"
DISAGREE = "disagree.json"
# The explicit exchange's phase (dtrain.engine.context): the update comes after it, so it was not applied.
_EXCHANGE_PHASE = "gradient exchange"


@dataclass(frozen=True)
class Vote:
    """What one survivor holds: the batch of its last complete step (None: it cannot tell, and why)."""

    rank: int
    pid: int
    batch: int | None
    saved: bool  # this rank wrote the survivor checkpoint
    reason: str  # why no state was kept, or what happened to it
    time: float


def world_folder(logs: Path, resumed_at: int, world_size: int) -> Path:
    """The votes of one world (the one that resumed at ``resumed_at`` on ``world_size`` ranks)."""
    return logs / SURVIVORS / f"from{resumed_at}-world{world_size}"


def read_votes(folder: Path) -> dict[int, Vote]:
    """rank -> its vote, for every survivor of that world that voted."""
    votes: dict[int, Vote] = {}
    for path in folder.glob(VOTE.format(rank="*")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            vote = Vote(**json.loads(path.read_text()))
            votes[vote.rank] = vote
    return votes


def voters(logs: Path) -> set[int]:
    """The process ids of every survivor that voted, in any world (the agent waits for its own workers')."""
    return {vote.pid for folder in (logs / SURVIVORS).glob("from*-world*") for vote in read_votes(folder).values()}


def forget(logs: Path) -> None:
    """Remove every world's votes and claims (a new job, or the change they were for is recorded)."""
    shutil.rmtree(logs / SURVIVORS, ignore_errors=True)


def newest_world(logs: Path) -> Path | None:
    """The folder of the most recent world that lost a peer (None: none did)."""
    folders = [p for p in (logs / SURVIVORS).glob("from*-world*") if p.is_dir()]
    return max(folders, key=lambda p: p.stat().st_mtime) if folders else None


# ------------------------------------------------------------------------------------ the worker's side


class Trainer(Protocol):
    """What this module reads of the step loop (:class:`dtrain.engine.trainer.Trainer`)."""

    ctx: TrialContext
    config: ExperimentConfig
    run_dir: Path
    ckpt_root: Path
    batches: int
    resumed_at: int
    total_batches: int
    batches_per_epoch: int
    callbacks: Callbacks
    train_metrics: MeanAccumulator



def keep_state(trainer: Trainer, exc: BaseException, start_steps: int) -> None:
    """Called with the exception that ends the loop: on a lost peer, save the last complete step (or say why
    not) before the worker reports its failure. Never raises: the failure report must still follow."""
    if os.environ.get(ENABLE_ENV) != "1" or not is_secondary(str(exc)) or dist.world_size() < 2:
        return
    ctx = trainer.ctx
    folder = world_folder(trainer.run_dir / "logs", trainer.resumed_at, ctx.world_size)
    batch, reason = complete_batch(trainer, start_steps)
    saved = False
    if batch is not None:
        try:
            saved, reason = _save_or_compare(trainer, folder, batch)
        except Exception as err:  # a second failure while saving (disk, a kill): the latest checkpoint stays
            batch, reason = None, f"the survivor save failed ({type(err).__name__}: {err})"
    with contextlib.suppress(OSError):  # the agent then waits its grace period, and the job falls back
        _write_vote(folder, Vote(ctx.rank, os.getpid(), batch, saved, reason, time.time()))
    if saved:
        log.warning("lost a peer at batch %d: %s", trainer.batches, reason)
    elif not reason.startswith("kept"):
        log.warning("lost a peer at batch %d: %s; the job falls back to its latest checkpoint", trainer.batches,
                    reason)


def complete_batch(trainer: Trainer, start_steps: int) -> tuple[int | None, str]:
    """The batch this rank's state is complete at, or None and why it cannot tell."""
    ctx, strategy = trainer.ctx, trainer.ctx.strategy
    if strategy.per_rank_optimizer_state or strategy.replicas_may_differ or strategy.has_server_ranks:
        return None, (f"sync.strategy {strategy.name} keeps part of the training state on each rank (not "
                      "replicated): the survivors cannot rebuild it")
    k, total = ctx.aggregation_frequency, trainer.total_batches
    synced = last_exchange(trainer.batches, k, total)
    expected = start_steps + exchanges_between(trainer.resumed_at, synced, k, total) * max(1, len(ctx.optimizers))
    steps = ctx.optimizer_steps
    if steps == expected + 1 and STATUS.phase == _EXCHANGE_PHASE:
        steps -= 1  # counted on entry; the exchange failed before the update
    if steps != expected:
        return None, (f"the optimizer stepped {steps - start_steps} time(s) since batch {trainer.resumed_at}, "
                      f"the schedule says {expected - start_steps}: the failure may have cut a step in half")
    if synced != trainer.batches and trainer.callbacks.step_end is not None:
        return None, (f"callbacks ran on batches {synced + 1}-{trainer.batches} after the last exchange")
    return synced, ""


def last_exchange(batches: int, k: int, total: int) -> int:
    """The last exchanging batch at or before ``batches`` (every ``k``-th, and the last of the run)."""
    return batches if batches == total else batches // k * k


def exchanges_between(after: int, upto: int, k: int, total: int) -> int:
    """How many exchanging batches lie in ``(after, upto]``."""
    return upto // k - after // k + (1 if upto == total and total % k else 0)


def _save_or_compare(trainer: Trainer, folder: Path, batch: int) -> tuple[bool, str]:
    """Claim the save for this world (the first survivor wins) and save, or compare with the claim."""
    root = trainer.ckpt_root
    me = {"rank": trainer.ctx.rank, "batch": batch}
    if not _write_new(folder / CLAIM, me):
        claim = _read(folder / CLAIM) or {}
        if claim.get("batch") == batch:
            return False, f"kept: rank {claim.get('rank')} saves batch {batch}, the batch this rank holds too"
        _write_new(folder / DISAGREE, me)
        withdrawn = _withdraw(root, claim.get("batch"))
        return False, (f"the survivors disagree on the last complete step (rank {claim.get('rank')}: batch "
                       f"{claim.get('batch')}, this rank: {batch})"
                       + (" (survivor checkpoint withdrawn)" if withdrawn else ""))
    held = checkpoint.latest(root)
    if held is not None and held.name.isdigit() and int(held.name) >= batch:
        return False, f"the latest checkpoint (batch {held.name}) already holds the last complete step"
    _save(trainer, batch)
    if (folder / DISAGREE).exists():  # seen after the commit: the other side may have looked too early
        _withdraw(root, batch)
        return False, "the survivors disagree on the last complete step"
    return True, f"saved the state after batch {batch} (the last step every survivor finished)"


def _save(trainer: Trainer, batch: int) -> None:
    """The state after ``batch`` as a checkpoint, written by this rank alone (the group is broken: no
    collective), as its world's rank 0 would, with the world size it was trained at."""
    ctx = trainer.ctx
    world = ctx.world_size
    dist.destroy_process_group()  # its barriers would wait on the dead peer; the save needs none
    extra = {"batches": batch, "batches_per_epoch": trainer.batches_per_epoch,
             "survivor": {"rank": ctx.rank, "world_size": world, "time": time.time()}}
    rank_extra = {"train_metrics": trainer.train_metrics.state_dict()}
    trainer.callbacks.save_into(extra, rank_extra)
    state = ctx.training_state()
    state.rank, state.world_size = 0, world
    # One more kept than usual: should the survivors turn out to disagree, the one before is the fallback.
    state.save(trainer.ckpt_root, batch, extra, trainer.config.checkpoint_storage.save_trial_latest + 1, rank_extra,
               optimizer_steps=ctx.optimizer_steps)


def _withdraw(root: Path, batch: object) -> bool:
    """Take back a survivor checkpoint at ``batch`` (if committed), so the latest one before it is used."""
    return isinstance(batch, int) and checkpoint.withdraw(root, batch, only_if_extra="survivor")


def _write_vote(folder: Path, vote: Vote) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / VOTE.format(rank=vote.rank)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(asdict(vote)))
    os.replace(tmp, path)


def _write_new(path: Path, record: dict[str, object]) -> bool:
    """Write ``record`` unless ``path`` exists (the first writer wins, atomically); whether this one did."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path) -> dict[str, object] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
