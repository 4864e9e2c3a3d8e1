"""PowerSGD gradient compression (Vogels et al., 2019) as a DDP comm hook that cannot deadlock.

Why not torch's ``powerSGD_hook``: on Gloo it deadlocks when DDP has several buckets (torch 2.13, seen
with a 581k-parameter MLP at default buckets): its second all-reduce is waited for inside a future
callback, which runs on the Gloo thread that must also progress the other buckets' all-reduces; and
``batched_powerSGD_hook`` fails with an AssertionError in ``_orthogonalize``. This hook does the two
all-reduces of a bucket on the calling (autograd) thread and returns a completed future. Every rank
handles buckets in the same order, so the collectives always match, whatever the bucket layout. The cost
is that a bucket's PowerSGD round trip does not overlap with the rest of backward; with gradients this
much smaller, that is the right trade.

Per bucket, each gradient viewed as an n x m matrix M (n = first dimension) with rank r << min(n, m):

    M += error                      error feedback: what compression lost last time is sent now
    P = M Q;  all-reduce(P);  P = orthonormal(P)
    Q = M^T P; all-reduce(Q) / N
    M_hat = P Q^T;  error = M - M_hat;  gradient = M_hat

Q is kept for the next step (warm start, one power iteration per step) and starts from the same seeded
random matrix on every rank. Vectors and matrices too small to gain (r (n + m) >= n m) are averaged
uncompressed, in one fused all-reduce per bucket.
"""

# No "from __future__ import annotations": DDP checks the comm hook's annotations at runtime.

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.profiling.comm import NULL_RECORDER, CommRecorder


class PowerSGDState:
    """Options and memory of :func:`powersgd_hook` (Q matrices, error-feedback buffers), per parameter."""

    __slots__ = ("error", "error_feedback", "iteration", "param_index", "q", "rank", "recorder", "seed",
                 "start_iteration", "warm_start")

    def __init__(self, model: nn.Module, rank: int, start_iteration: int, error_feedback: bool, warm_start: bool,
                 seed: int = 0, recorder: CommRecorder = NULL_RECORDER) -> None:
        # Keyed by the parameter's position in the model: stable across DDP's bucket rebuild and across a
        # checkpoint/resume, unlike bucket indices or object ids.
        self.param_index = {id(p): i for i, p in enumerate(model.parameters())}
        self.rank = rank
        self.start_iteration = start_iteration
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.seed = seed
        self.recorder = recorder
        self.iteration = 0
        self.q: dict[int, torch.Tensor] = {}
        self.error: dict[int, torch.Tensor] = {}

    def compressible(self, grad: torch.Tensor) -> bool:
        if grad.dim() < 2:
            return False
        n, m = grad.shape[0], grad.numel() // grad.shape[0]
        return self.rank < min(n, m) and self.rank * (n + m) < n * m

    def initial_q(self, index: int, m: int, like: torch.Tensor) -> torch.Tensor:
        """The same random start on every rank: seeded by (seed, parameter, iteration)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index * 7919 + self.iteration)
        q = torch.randn(m, self.rank, generator=generator, dtype=torch.float32)
        return q.to(device=like.device, dtype=like.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "q": {k: v.cpu() for k, v in self.q.items()},
                "error": {k: v.cpu() for k, v in self.error.items()}}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.iteration = int(state["iteration"])
        self.q = {int(k): v.to(device) for k, v in state["q"].items()}
        self.error = {int(k): v.to(device) for k, v in state["error"].items()}


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    # Reduced QR: the columns of Q span P's column space. fp32 at least: QR in half precision is unstable.
    q, _ = torch.linalg.qr(p.float(), mode="reduced")
    return q.to(p.dtype)


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket's gradients with rank-``state.rank`` PowerSGD compression (see module doc)."""
    buffer = bucket.buffer()
    world = dist.get_world_size()
    if state.iteration < state.start_iteration:
        # Warm-up with exact averaging: early gradients change fast and compress badly.
        with state.recorder.collective(buffer.numel() * buffer.element_size()):
            dist.all_reduce(buffer)
        buffer.div_(world)
        return _done(state, bucket, buffer)

    grads = bucket.gradients()
    indices = [state.param_index[id(p)] for p in bucket.parameters()]
    matrices = [(i, g.view(g.shape[0], -1)) for i, g in zip(indices, grads, strict=True) if state.compressible(g)]
    plain = [g for g in grads if not state.compressible(g)]
    # What goes on the wire: the uncompressible tensors whole, and P (n x r) and Q (m x r) per matrix.
    wire = (sum(g.numel() for g in plain) + sum(state.rank * sum(m.shape) for _, m in matrices)) * buffer.element_size()
    with state.recorder.collective(wire):
        plain_flat = torch.cat([g.reshape(-1) for g in plain]) if plain else None
        plain_work = dist.all_reduce(plain_flat, async_op=True) if plain_flat is not None else None
        if matrices:
            _compress_and_average(state, matrices, world)
        if plain_work is not None and plain_flat is not None:
            plain_work.wait()
            plain_flat.div_(world)
            offset = 0
            for g in plain:
                g.copy_(plain_flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
    return _done(state, bucket, buffer)


def _compress_and_average(state: PowerSGDState, matrices: list[tuple[int, torch.Tensor]], world: int) -> None:
    """One power iteration per matrix, all matrices of the bucket fused into one P and one Q all-reduce;
    the averaged low-rank approximation is written back into the bucket."""
    ps, qs = [], []
    for index, m in matrices:
        if state.error_feedback:
            error = state.error.get(index)
            if error is not None:
                m.add_(error)
            state.error[index] = m.clone()  # M before compression; M_hat is subtracted below
        q = state.q.get(index) if state.warm_start else None
        if q is None:
            q = state.initial_q(index, m.shape[1], m)
        qs.append(q)
        ps.append(m @ q)
    p_flat = torch.cat([p.reshape(-1) for p in ps])
    dist.all_reduce(p_flat)
    ps = [_orthonormalize(p) for p in _split(p_flat, [p.shape for p in ps])]
    q_flat = torch.cat([(m.t() @ p).reshape(-1) for (_, m), p in zip(matrices, ps, strict=True)])
    dist.all_reduce(q_flat)
    q_flat.div_(world)
    qs = _split(q_flat, [q.shape for q in qs])
    for (index, m), p, q in zip(matrices, ps, qs, strict=True):
        torch.matmul(p, q.t(), out=m)  # writes M_hat straight into the bucket
        if state.error_feedback:
            state.error[index].sub_(m)
        state.q[index] = q


def _split(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        numel = shape.numel()
        out.append(flat[offset:offset + numel].view(shape))
        offset += numel
    return out


def _done(state: PowerSGDState, bucket: dist.GradBucket, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    if bucket.is_last():
        state.iteration += 1
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut
