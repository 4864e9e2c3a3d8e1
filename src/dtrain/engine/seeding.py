"""Seeding, one scheme for both APIs: the global RNGs alike on every rank (models start equal), and a
per-rank stream where ranks must differ (dropout in a Trial, ``ctx.rank_generator()``)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed torch's, numpy's and Python's global RNGs with ``seed``."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """A 63-bit seed for ``rank``'s own stream, decorrelated from the others (numpy's SeedSequence)."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(2, np.uint64)[0] >> np.uint64(1))
