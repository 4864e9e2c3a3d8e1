"""DDP's gradient buckets, as many and as big as DDP makes them: what the cost model's exchange is made of.

DDP lays its buckets out by torch's ``compute_bucket_assignment_by_size`` (``reducer.cpp``), on the gradients in
the order backward produces them (after its first iteration's rebuild; for a model that uses its layers in the
order it registered them, the reverse of that order, which is also DDP's first guess): a bucket takes tensors
until it holds *at least* its limit, so it keeps the tensor that crosses the limit. The limits are
``bucket_cap_mb`` for every bucket where a cap is given (dtrain always gives its ``tensor_fusion_threshold``),
and a small 1 MiB first bucket, then 25 MiB, where DDP runs at its defaults. So 1.02 MiB of gradients in a few
tensors is one exchange, not two.

Written here rather than called from torch (``torch.distributed._compute_bucket_assignment_by_size`` is
private and wants the tensors): the planner lays out the byte counts a run recorded, long after the run. The
tests hold this against torch's own function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

# DDP's defaults, where no cap is given: the first gradients go out in a small bucket so communication starts
# early, then 25 MiB buckets.
FIRST_BUCKET_BYTES, BUCKET_BYTES = 1 * 2**20, 25 * 2**20


def limits(cap_mb: float | None) -> tuple[float, float]:
    """(first bucket's limit, the others') in bytes, for DDP given ``bucket_cap_mb=cap_mb`` (None: its default)."""
    if cap_mb is None:
        return FIRST_BUCKET_BYTES, BUCKET_BYTES
    cap = int(cap_mb * 2**20)  # as DDP rounds it
    return cap, cap


def layout(tensor_bytes: Sequence[int], cap_mb: float | None) -> list[int]:
    """Bytes of each bucket DDP makes of gradients of ``tensor_bytes`` (in backward's order), at ``cap_mb``."""
    first, cap = limits(cap_mb)
    buckets: list[int] = []
    size, limit = 0, first
    for nbytes in tensor_bytes:
        size += nbytes
        if size >= limit:
            buckets.append(size)
            size, limit = 0, cap
    if size:
        buckets.append(size)
    return buckets


def count_without_tensors(nbytes: float, cap_mb: float | None) -> int:
    """DDP's buckets for ``nbytes`` of gradients where their tensors are unknown (a profile written before they
    were recorded, a model on paper): as if the tensors were fine-grained."""
    first, cap = limits(cap_mb)
    if cap <= 0:  # every tensor its own bucket, and their count unknown: priced at DDP's defaults
        first, cap = limits(None)
    return 1 + math.ceil(max(0.0, nbytes - first) / cap)


def model_layout(gradient_bytes: Sequence[Sequence[int]], cap_mb: float | None) -> list[int]:
    """Every model's buckets (a DDP each), at ``cap_mb``: the exchange of one step."""
    return [b for tensors in gradient_bytes for b in layout(tensors, cap_mb)]


def gradient_bytes(models: Sequence[nn.Module]) -> list[list[int]]:
    """Each model's trainable tensors' gradient bytes in the order backward produces them, which DDP buckets
    them by: for a model that uses its layers in the order it registered them, the reverse of that order
    (DDP's own first guess, before it sees a backward)."""
    return [[p.numel() * p.element_size() for p in reversed(list(model.parameters())) if p.requires_grad]
            for model in models]
