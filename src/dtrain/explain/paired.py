"""Paired speed-up ratios over rounds, shared by ``dtrain bench`` and ``dtrain doctor --verify``.

On a shared machine absolute speeds drift between runs, so one case's median over another's misleads
(on one run a change measured 0.95x that way while its per-round ratios were 1.50, 0.78 and 1.58). Each
case is therefore compared with the baseline measured in the *same* round, and the figure reported is the
median of those per-round ratios, beside a range that holds the true median with a stated confidence.

The range is the distribution-free interval for a median: the k-th smallest to the k-th largest of R
ratios holds it with probability ``1 - 2 x P(Binomial(R, 1/2) < k)``. Up to 5 rounds k is 1, the smallest
to the largest ratio: ``1 - 2 x 0.5**R`` (75% for 3 rounds, 94% for 5). From 6 rounds on, k is the largest
that keeps at least :data:`LEVEL` (75%, what 3 rounds give), so that one outlying round stops widening the
range once there are enough rounds to outvote it; a min-max range could only grow with every round.

A range wider than ``target`` (``(high - low) / median``) is too wide to rank changes by; with a round
budget (``--max-repeats``) more rounds are run until every range is narrow enough or the budget is spent.
One round has no range at all: its noise is unknown, which is said rather than hidden.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, TypeVar

from dtrain.errors import UserError

T = TypeVar("T")

DEFAULT_TARGET_SPREAD = 0.10
# The least confidence a range trimmed of outlying rounds must keep (what 3 rounds' min-max gives).
LEVEL = 0.75
ONE_ROUND = "unknown: one round"


def ratios(values: Sequence[float], baselines: Sequence[float]) -> list[float]:
    """Per-round ratios ``values[r] / baselines[r]`` (a round without a baseline figure is left out)."""
    return [v / b for v, b in zip(values, baselines, strict=False) if b]


def median(values: Sequence[float]) -> float | None:
    """The median, or None without values."""
    return statistics.median(values) if values else None


def _coverage(rounds: int, k: int) -> float:
    """Probability that the k-th smallest to k-th largest of ``rounds`` samples hold the true median."""
    below = sum(math.comb(rounds, i) for i in range(k))
    return 1 - 2 * below / 2 ** rounds


def _trim(rounds: int) -> int:
    """Which order statistics bound the range: k-th smallest to k-th largest (1: min to max)."""
    k = 1
    while k + 1 <= rounds // 2 and _coverage(rounds, k + 1) >= LEVEL:
        k += 1
    return k


def median_confidence(rounds: int) -> float:
    """Probability that the reported range of ``rounds`` independent ratios holds their true median."""
    return _coverage(rounds, _trim(rounds)) if rounds > 1 else 0.0


def interval(values: Sequence[float]) -> tuple[float, float] | None:
    """The reported range (see the module's docstring); None without values."""
    if not values:
        return None
    ordered, k = sorted(values), _trim(len(values))
    return ordered[k - 1], ordered[-k]


def spread(values: Sequence[float]) -> float | None:
    """``(high - low) / median`` of the range; None with fewer than two values (one round: no spread)."""
    mid, span = median(values), interval(values)
    if len(values) < 2 or mid is None or span is None:
        return None
    return (span[1] - span[0]) / mid if mid > 0 else math.inf


def is_narrow(values: Sequence[float], target: float) -> bool:
    """Whether the range is measured (2+ rounds) and no wider than ``target``."""
    width = spread(values)
    return width is not None and width <= target


def verdict(values: Sequence[float], target: float) -> str:
    """Whether the range is narrow enough to rank by, in the user's words."""
    width = spread(values)
    if width is None:
        return "one round: noise unknown" if values else "not measured"
    low, high = interval(values) or (0.0, 0.0)
    span = f"spread {low:.2f}-{high:.2f}x"
    if width <= target:
        return f"{span}: narrow enough ({100 * width:.0f}% <= {100 * target:.0f}%)"
    return f"{span}: too wide to rank, add rounds"


def summary(values: Sequence[float], target: float) -> dict[str, Any]:
    """One ratio's figures for ``--json``: median, range, spread, whether narrow enough, and the sentence."""
    width = spread(values)
    span = interval(values)
    return {"median": median(values), "range": list(span) if span else None,
            "spread": width, "narrow": None if width is None else width <= target,
            "spread_verdict": verdict(values, target)}


def noise(rounds: int) -> str:
    """What the ranges say about run-to-run noise, for ``--json`` and the table's footer."""
    if rounds <= 1:
        return ONE_ROUND
    return f"{rounds} rounds: each range holds its true median with {100 * median_confidence(rounds):.0f}% confidence"


def footer(rounds: int, baseline: str) -> str:
    """The table's last line: how the ratios were formed, and how much to trust them."""
    if rounds <= 1:
        return ("noise: unknown: one round, no spread: these figures carry run-to-run noise of unknown size "
                "(--repeats 3 measures it)\n")
    return (f"ratios: median of {rounds} per-round ratios over the same round's {baseline}; each range holds the "
            f"true median with {100 * median_confidence(rounds):.0f}% confidence\n")


def check_rounds(repeats: int, max_repeats: int | None, target: float) -> int:
    """Validate ``--repeats``, ``--max-repeats`` and ``--target-spread``; return the round budget."""
    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    budget = repeats if max_repeats is None else max_repeats
    if budget < repeats:
        raise UserError(f"--max-repeats {budget} is below --repeats {repeats}: it is the most rounds to run, "
                        f"so at least --repeats")
    if not (math.isfinite(target) and target > 0):
        raise UserError(f"--target-spread must be a positive fraction like 0.10 (10% of the median), got {target}")
    return budget


def more_rounds(done: int, repeats: int, budget: int, ratio_sets: Sequence[Sequence[float]], target: float) -> bool:
    """Whether to run another round: always up to ``repeats``, then while any range is wider than ``target``
    and the budget lasts."""
    if done < repeats:
        return True
    return done < budget and any(not is_narrow(values, target) for values in ratio_sets)


def order(items: Sequence[T], round_: int, keep_first: bool = False) -> list[T]:
    """The round's running order: odd rounds reversed, so that drift over a session hits every case alike;
    with ``keep_first`` the first item (the baseline) still runs first, next to the round's start."""
    if round_ % 2 == 0:
        return list(items)
    if keep_first and items:
        return [items[0], *reversed(items[1:])]
    return list(reversed(items))
