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

    M = gradient + error            error feedback: what compression lost last time is sent now
    P = M Q;  all-reduce(P);  P = orthonormal(P)
    Q = M^T P; all-reduce(Q) / N
    M_hat = P Q^T;  error = M - M_hat;  gradient = M_hat

Q is kept for the next step (warm start, one power iteration per step) and starts from the same seeded
random matrix on every rank. Vectors and matrices too small to gain (r (n + m) >= n m) are averaged
uncompressed, in P's all-reduce: two collectives per bucket in all (one for a bucket of vectors only).

Each collective reports to the profiler on its own, so ``comm_busy`` is time spent in all-reduces and
the compression math counts as compute: on a slow link a reader must be able to tell the two apart.
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
    if matrices:
        _compress_and_average(state, matrices, plain, world)
    else:
        _average_plain(state, plain, world)
    return _done(state, bucket, buffer)


def _average_plain(state: PowerSGDState, plain: list[torch.Tensor], world: int) -> None:
    """A bucket of vectors only (biases, norms): one fused exact all-reduce."""
    if not plain:
        return
    flat = torch.cat([g.reshape(-1) for g in plain])
    with state.recorder.collective(flat.numel() * flat.element_size()):
        dist.all_reduce(flat)
    flat.div_(world)
    _scatter(flat, plain)


def _compress_and_average(state: PowerSGDState, matrices: list[tuple[int, torch.Tensor]], plain: list[torch.Tensor],
                          world: int) -> None:
    """One power iteration per matrix; the bucket's P matrices and its uncompressed tensors travel in one
    all-reduce, its Q matrices in a second: two collectives per bucket, whatever its content. The
    averaged low-rank approximation is written back into the bucket.

    Why it is written this way (bench/powersgd_link.py): on a slow link every pass over M costs about as
    much as the whole all-reduce of P and Q, so the math reads and writes M as few times as it can. Q is
    computed as (P^T M)^T, not M^T P: torch's CPU matmul of a transposed square matrix by a skinny one is
    much slower. The error-feedback buffer is kept and updated in place: allocating a fresh copy of M per
    step (``clone``) page-faults on every one of its pages."""
    sources, ps = [], []
    for index, m in matrices:
        source = m
        if state.error_feedback:
            error = state.error.get(index)
            if error is None:
                error = state.error[index] = m.clone()  # once per parameter: the buffer is reused after
            else:
                error.add_(m)  # the buffer now holds M = gradient + what compression lost last time
            source = error
        q = state.q.get(index) if state.warm_start else None
        if q is None:
            q = state.initial_q(index, m.shape[1], m)
        sources.append(source)
        ps.append(source @ q)
    # Uncompressed tensors ride with P: one latency on the link instead of two (an async all-reduce of
    # their own would only overlap with math that now takes a few milliseconds).
    p_flat = torch.cat([p.reshape(-1) for p in ps] + [g.reshape(-1) for g in plain])
    with state.recorder.collective(p_flat.numel() * p_flat.element_size()):
        dist.all_reduce(p_flat)
    p_numel = sum(p.numel() for p in ps)
    if plain:
        _scatter(p_flat[p_numel:].div_(world), plain)
    ps = [_orthonormalize(p) for p in _split(p_flat[:p_numel], [p.shape for p in ps])]
    # Q^T = P^T M (r x m, contiguous) instead of Q = M^T P: see the doc above.
    qt_flat = torch.cat([(p.t() @ source).reshape(-1) for source, p in zip(sources, ps, strict=True)])
    with state.recorder.collective(qt_flat.numel() * qt_flat.element_size()):
        dist.all_reduce(qt_flat)
    qt_flat.div_(world)
    qts = _split(qt_flat, [torch.Size((state.rank, m.shape[1])) for _, m in matrices])
    for (index, m), p, qt in zip(matrices, ps, qts, strict=True):
        if state.error_feedback:
            state.error[index].addmm_(p, qt, alpha=-1)  # error = M - P Q^T, in place
        torch.mm(p, qt, out=m)  # writes M_hat = P Q^T straight into the bucket
        state.q[index] = qt.t()  # m x r, as the next step's P = M Q expects


def _scatter(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors``."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


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
    # On CUDA the future must know the buffer's device: DDP then waits, on its own stream, for the
    # kernels that wrote it (a future without devices hands over the tensor without that order).
    devices = [buffer.device] if buffer.device.type == "cuda" else None
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
    fut.set_result(buffer)
    return fut
