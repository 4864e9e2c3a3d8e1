"""``parameter_server``: server ranks hold the master weights and the optimizer; workers push gradients
and pull fresh weights.

Roles: the last ``servers`` ranks are servers, the others workers (the only ranks that train: data is
split among them). Parameters are assigned whole to servers, balancing element counts; each server steps
the trial's own optimizer over the parameters it owns (torch optimizers skip parameters whose gradient
is None). Everything travels as tensors over torch.distributed: no pickled objects, no sockets of ours.

* ``sync``: per update, each server's gradients are summed with ``reduce`` onto the server over a group of
  {workers, that server}, averaged and applied, and the new weights sent back with ``broadcast``. The
  result equals all-reduce SGD on the same global batch.
* ``async``: workers push (``send``) whenever they finish a step and the server applies each gradient on
  arrival. Staleness is bounded as in stale synchronous parallel (SSP): a worker's clock is the number of
  gradients it has pushed, and the server only answers a worker (which then computes its next gradient)
  when its clock is at most ``staleness`` ahead of the slowest worker's. So the weights a worker computes
  iteration c on contain every worker's gradients of iterations before c - staleness. The server asserts
  this bound on every reply and writes its statistics to ``ps_stats.json``.

On NCCL the async control messages (who pushes or pulls, and its clock) travel on a Gloo side group: NCCL
has no receive from any source, and its tensors must live on the GPU; gradients and weights still go over
NCCL, between named ranks. A server that owns no parameter (more servers than parameters) exchanges no
tensor at all, on either side: NCCL has nothing to send for it.

Limitation: an LR scheduler stepped inside ``train_batch`` runs on the workers, not on the servers' optimizer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.profiling.comm import NULL_RECORDER, CommRecorder
from dtrain.profiling.record import SERVER
from dtrain.sync.base import SyncStrategy, broadcast_from_chief
from dtrain.sync.registry import register

if TYPE_CHECKING:
    from dtrain.sync.options import ParameterServerOptions, StrategyConfig

PUSH, PULL = 1, 2
# Momentum from which asynchrony's own (about 1 - 1/workers, Mitliagkas et al. 2016) is worth a warning: the
# demo's 0.9 did not converge with 2 async workers, 0.5 did (docs/strategies.md, "async").
MOMENTUM_WARNING = 0.5

log = logging.getLogger(__name__)


def assign_to_servers(params: list[nn.Parameter], servers: int) -> list[int]:
    """Server index of each parameter: whole parameters, greedily balancing element counts."""
    load = [0] * servers
    owner = []
    for p in params:
        j = min(range(servers), key=lambda s: load[s])
        owner.append(j)
        load[j] += p.numel()
    return owner


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


@dataclass
class ServerStats:
    updates: int = 0
    skipped: int = 0
    max_clock_spread: int = 0
    pushes: dict[int, int] = field(default_factory=dict)


@register
class ParameterServerStrategy(SyncStrategy):
    name = "parameter_server"
    exchanges_in_step = True
    has_server_ranks = True
    exchange = SERVER
    per_rank_optimizer_state = True  # the servers' optimizer shards live in their own rank files

    def __init__(self, device: torch.device, options: ParameterServerOptions,
                 recorder: CommRecorder = NULL_RECORDER) -> None:
        super().__init__(device, recorder)
        self.options = options
        self.rank = dist.get_rank()
        world = dist.get_world_size()
        self.server_ranks = list(range(world - options.servers, world))
        self.worker_ranks = list(range(world - options.servers))
        self.is_server = self.rank in self.server_ranks
        # Every rank must create every group, in the same order.
        self.dp_group = dist.new_group(self.worker_ranks)
        self.server_groups = [dist.new_group([*self.worker_ranks, s]) for s in self.server_ranks]
        # Async control messages: a CPU-tensor, any-source channel (the default group unless it is NCCL).
        self.control = dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else None
        self.params: list[nn.Parameter] = []
        self.owner: list[int] = []
        self.clock = 0  # async: gradients this worker has pushed
        self.stats = ServerStats()
        self._server_clocks = dict.fromkeys(self.worker_ranks, 0)
        self._deferred: list[int] = []
        self._pulls = 0

    @classmethod
    def from_config(cls, config: StrategyConfig | None, device: torch.device,
                    recorder: CommRecorder = NULL_RECORDER) -> ParameterServerStrategy:
        from dtrain.sync.options import ParameterServerOptions

        return cls(device, config.sync.parameter_server if config is not None else ParameterServerOptions(), recorder)

    @classmethod
    def training_slots(cls, config: StrategyConfig) -> int:
        return config.resources.slots_per_trial - config.sync.parameter_server.servers

    @classmethod
    def check_config(cls, config: StrategyConfig) -> None:
        super().check_config(config)
        servers, slots = config.sync.parameter_server.servers, config.resources.slots_per_trial
        if servers >= slots:
            raise ValueError(f"sync.parameter_server.servers is {servers} with resources.slots_per_trial {slots}: no "
                             f"worker left; use at least {servers + 1} slots (servers + workers) or fewer servers")

    # ------------------------------------------------------------------------------------ roles
    @property
    def dp_rank(self) -> int:
        return self.worker_ranks.index(self.rank) if not self.is_server else 0

    @property
    def dp_world(self) -> int:
        return len(self.worker_ranks)

    def setup_model(self, model: nn.Module) -> nn.Module:
        if self.params:
            raise ValueError("parameter_server supports one wrapped model per trial")
        model = model.to(self.device)
        broadcast_from_chief(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.owner = assign_to_servers(self.params, len(self.server_ranks))
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.rank == 0:
            self._warn_of_momentum(optimizer)
        return optimizer

    def _owned(self, server_index: int) -> list[nn.Parameter]:
        return [p for p, j in zip(self.params, self.owner, strict=True) if j == server_index]

    # ---------------------------------------------------------------------------- worker side
    def exchange_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # Gradients go out, weights come back: twice the parameters' bytes.
        with self.recorder.collective(2 * sum(p.numel() * p.element_size() for p in self.params)):
            if self.options.mode == "sync":
                self._sync_round_worker()
            else:
                self._async_push()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Workers do not update: the servers did, and the new weights are already in place."""

    def _sync_round_worker(self) -> None:
        for j, server in enumerate(self.server_ranks):
            owned = self._owned(j)
            if not owned:
                continue
            grads = _flat([p.grad for p in owned])
            dist.reduce(grads, dst=server, group=self.server_groups[j])
            weights = _flat([p.data for p in owned])
            dist.broadcast(weights, src=server, group=self.server_groups[j])
            _unflatten_into(weights, [p.data for p in owned])

    def _async_push(self) -> None:
        self.clock += 1
        header = torch.tensor([PUSH, self.clock], dtype=torch.int64)
        for j, server in enumerate(self.server_ranks):
            dist.send(header, dst=server, group=self.control)
            owned = self._owned(j)
            if owned:
                dist.send(_flat([p.grad for p in owned]), dst=server)
        self._receive_weights()

    def refresh(self) -> None:
        """Async: fetch the newest weights before validating or checkpointing (sync: already fresh)."""
        if self.options.mode == "async" and not self.is_server:
            header = torch.tensor([PULL, self.clock], dtype=torch.int64)
            for server in self.server_ranks:
                dist.send(header, dst=server, group=self.control)
            self._receive_weights()

    def _receive_weights(self) -> None:
        for j, server in enumerate(self.server_ranks):
            owned = self._owned(j)
            if not owned:
                continue
            weights = _flat([p.data for p in owned])
            dist.recv(weights, src=server)
            _unflatten_into(weights, [p.data for p in owned])

    # ---------------------------------------------------------------------------- server side
    def serve_run(self, optimizer: torch.optim.Optimizer, schedule: Iterator[tuple[int, bool, bool, bool]],
                  checkpoint: Callable[[int], None], batches: int) -> None:
        """A server rank's whole run: keep step with the workers' schedule, serving their gradients, and
        join their checkpoints (collectives) at the same batches."""
        updates, last_ckpt = self.stats.updates, -1
        for batches, sync, validate, ckpt in schedule:
            updates += sync
            if validate or ckpt:
                self.serve(optimizer, updates, workers_pull=True)
            if ckpt:
                checkpoint(batches)
                last_ckpt = batches
        self.serve(optimizer, updates, workers_pull=True)
        if last_ckpt != batches:
            checkpoint(batches)

    def serve(self, optimizer: torch.optim.Optimizer, updates: int, workers_pull: bool) -> None:
        """Serve until every worker has made ``updates`` pushes (and, async, pulled once if asked)."""
        j = self.server_ranks.index(self.rank)
        owned = self._owned(j)
        if self.options.mode == "sync":
            while self.stats.updates < updates:
                self._sync_round_server(optimizer, j, owned)
            return
        self._pulls = 0
        while (min(self._server_clocks.values()) < updates or self._deferred
               or (workers_pull and self._pulls < len(self.worker_ranks))):
            self._async_serve_one(optimizer, owned)

    def _sync_round_server(self, optimizer: torch.optim.Optimizer, j: int, owned: list[nn.Parameter]) -> None:
        if not owned:  # the workers send this server nothing either
            self.stats.updates += 1
            return
        grads = _flat([torch.zeros_like(p) for p in owned])
        dist.reduce(grads, dst=self.rank, group=self.server_groups[j])
        grads.div_(len(self.worker_ranks))
        self._apply(optimizer, owned, grads)
        weights = _flat([p.data for p in owned])
        dist.broadcast(weights, src=self.rank, group=self.server_groups[j])

    def _apply(self, optimizer: torch.optim.Optimizer, owned: list[nn.Parameter], grads: torch.Tensor) -> None:
        self.stats.updates += 1
        if not bool(torch.isfinite(grads).all()):
            # An overflowed (16-mixed) or diverged gradient: the workers skip this step too (they agree on
            # it by all-reduce), so the server keeps its weights and optimizer state as they are.
            self.stats.skipped += 1
            return
        for p in self.params:
            p.grad = None  # parameters of other servers: skipped by the optimizer
        for p in owned:
            p.grad = torch.empty_like(p)
        _unflatten_into(grads, [p.grad for p in owned])
        optimizer.step()

    def _warn_of_momentum(self, optimizer: torch.optim.Optimizer) -> None:
        """Async: every worker's gradient is a step of its own, on weights up to ``staleness`` updates old, and
        that staleness acts as extra momentum; the trial's momentum, tuned for one averaged step per global batch,
        can then keep the run from converging. Said once, by the chief (a worker), where it is likely."""
        workers = len(self.worker_ranks)
        momentum = max((float(g.get("momentum", 0.0) or 0.0) for g in optimizer.param_groups), default=0.0)
        if self.options.mode != "async" or workers < 2 or momentum < MOMENTUM_WARNING:
            return
        log.warning("async parameter server: each of the %d workers' gradients is applied as it arrives (%d updates "
                    "per global batch, each on weights up to %d update(s) old), and that staleness acts as momentum "
                    "of its own (about %.2f) on top of the optimizer's %.2g: if the loss does not fall, lower the "
                    "momentum or the learning rate (mode: sync is all-reduce SGD, with no such effect)",
                    workers, workers, self.options.staleness, 1 - 1 / workers, momentum)

    def _async_serve_one(self, optimizer: torch.optim.Optimizer, owned: list[nn.Parameter]) -> None:
        header = torch.zeros(2, dtype=torch.int64)
        worker = dist.recv(header, group=self.control)  # from any worker; a global rank
        kind, clock = int(header[0]), int(header[1])
        if kind == PULL:
            self._pulls += 1
            self._send_weights(worker, owned)
            return
        if owned:
            grads = _flat([torch.zeros_like(p) for p in owned])
            dist.recv(grads, src=worker)
            self._apply(optimizer, owned, grads)
        else:
            self.stats.updates += 1
        self._server_clocks[worker] = clock
        self.stats.pushes[worker] = self.stats.pushes.get(worker, 0) + 1
        self._deferred.append(worker)
        self._answer_deferred(owned)

    def _answer_deferred(self, owned: list[nn.Parameter]) -> None:
        slowest = min(self._server_clocks.values())
        for worker in list(self._deferred):
            spread = self._server_clocks[worker] - slowest
            if spread <= self.options.staleness:  # else the worker waits for the slowest to catch up
                self.stats.max_clock_spread = max(self.stats.max_clock_spread, spread)
                self._deferred.remove(worker)
                self._send_weights(worker, owned)

    def _send_weights(self, worker: int, owned: list[nn.Parameter]) -> None:
        if owned:
            dist.send(_flat([p.data for p in owned]), dst=worker)

    def write_stats(self, run_dir: Path) -> None:
        if not self.is_server:
            return
        data = {"rank": self.rank, "mode": self.options.mode, "staleness_bound": self.options.staleness,
                "updates": self.stats.updates, "skipped_updates": self.stats.skipped,
                "max_clock_spread": self.stats.max_clock_spread,
                "pushes_per_worker": {str(k): v for k, v in self.stats.pushes.items()}}
        (run_dir / f"ps_stats.rank{self.rank}.json").write_text(json.dumps(data, indent=2))

    def state_dict(self) -> dict[str, Any]:
        return {"clock": self.clock, "updates": self.stats.updates,
                "server_clocks": {str(k): v for k, v in self._server_clocks.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock = int(state.get("clock", 0))
        self.stats.updates = int(state.get("updates", 0))
        self._server_clocks.update({int(k): int(v) for k, v in state.get("server_clocks", {}).items()})
