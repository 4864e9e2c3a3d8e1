"""ASHA's brackets and rungs, computed as Determined's ``adaptive_asha`` computes them.

``adaptive_asha`` trains every trial to its bracket's first rung and keeps the best 1/``divisor`` of the
trials that finished each rung. Its decisions are Optuna's ``SuccessiveHalvingPruner``'s: when a trial
finishes a rung it goes on if it is in the top ``max(n // divisor, 1)`` of the ``n`` trials of its bracket
that have finished that rung so far, itself included (Determined's rule too). So the first trial to finish a
rung always goes on, and until a rung has been finished by ``divisor`` trials, "the best 1/divisor" is the
best of fewer than ``divisor``.

As in Determined (``master/pkg/searcher/adaptive_asha.go``, ``asha_stopping.go``):

* the rungs are at most ``max_rungs``, and fewer when the top rung could not hold a trial: at most
  ``log_divisor(max_length) + 1`` (the first rung at least one unit long) and ``log_divisor(max_trials) + 1``
  (a real selection at every rung), each logarithm rounded down in floating point as Determined does;
* rung k of a bracket of r rungs ends at ``max(max_length // divisor ** (r - 1 - k), 1)``;
* ``mode`` sets the brackets: ``aggressive`` one of r rungs, ``standard`` those of ``(r - 1) // 2 + 1`` to r
  rungs, ``conservative`` those of 1 to r rungs (``bracket_rungs`` gives them explicitly), most rungs first;
  ``max_trials`` is shared out so that each bracket gets about the same training budget.

Torch- and Optuna-free: ``dtrain check`` uses it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from dtrain.config.model import Length, SearcherConfig

Unit = Literal["batches", "epochs"]


@dataclass(frozen=True)
class Brackets:
    """A search's brackets: each one's rung ends (in ``unit``; the last one is a full trial) and trials."""

    unit: Unit
    lengths: tuple[tuple[int, ...], ...]
    trials: tuple[int, ...]
    note: str | None = None

    def of(self, number: int) -> int:
        """The bracket of trial ``number``: the brackets take turns, each while it has trials left, so that
        every bracket has trials running early (as Determined starts them all at once)."""
        done = 0
        for level in sorted(set(self.trials)):
            active = [b for b, n in enumerate(self.trials) if n > done]
            span = (level - done) * len(active)
            if number < span:
                return active[number % len(active)]
            number -= span
            done = level
        return 0  # beyond the search's trials: no trial has this number


def _units(length: Length) -> tuple[Unit, int]:
    unit: Unit = "batches" if length.batches is not None else "epochs"
    return unit, int(length.batches if length.batches is not None else length.epochs)  # type: ignore[arg-type]


def _log_floor(x: int, base: int) -> int:
    # Determined's int(math.Log(x) / math.Log(base)): floating point, so at some exact powers (243 with
    # divisor 3, 1000 with divisor 10) one less than the exact logarithm. Kept: the same YAML, the same rungs.
    return int(math.log(x) / math.log(base))


def rung_count(searcher: SearcherConfig, length: Length) -> tuple[int, str | None]:
    """The rungs of the search's largest bracket, and a note when ``max_length`` made them fewer than
    ``max_rungs`` (fewer because of ``max_trials``: :func:`too_few_trials` says so, louder)."""
    unit, total = _units(length)
    by_length = _log_floor(total, searcher.divisor) + 1
    rungs = min(searcher.max_rungs, by_length, _trial_cap(searcher))
    note = None
    if by_length < searcher.max_rungs and rungs == by_length:
        note = (f"searcher.max_rungs {searcher.max_rungs} would make the first rung shorter than one {unit[:-1]} "
                f"of {total}; using {rungs} rung(s)")
    return rungs, note


def _trial_cap(searcher: SearcherConfig) -> int:
    if searcher.max_trials is None:
        return searcher.max_rungs
    return _log_floor(searcher.max_trials, searcher.divisor) + 1


def rungs(count: int, divisor: int, total: int) -> tuple[int, ...]:
    """Rung ends of a bracket of ``count`` rungs: ``max(total // divisor ** (count - 1 - k), 1)``, equal ends
    merged (possible in explicit ``bracket_rungs`` only)."""
    ends = sorted({max(total // divisor ** (count - 1 - k), 1) for k in range(count)})
    return tuple(ends)


def bracket_trials(max_trials: int, divisor: int, counts: tuple[int, ...]) -> tuple[int, ...]:
    """``max_trials`` shared among brackets of ``counts`` rungs, each with about the same budget (a bracket of
    r rungs spends about r full trials per ``divisor ** (r - 1)`` trials), at least one each; what rounding
    leaves goes to the first bracket. As Determined's getBracketMaxTrials."""
    weights = [divisor ** (r - 1) / r for r in counts]
    total = sum(weights)
    shares = [max(int(w / total * max_trials), 1) for w in weights]
    shares[0] += max(max_trials - sum(shares), 0)
    return tuple(shares)


def brackets(searcher: SearcherConfig, length: Length) -> Brackets:
    """Every bracket of the search: one full-length bracket but for ``adaptive_asha``."""
    unit, total = _units(length)
    trials = searcher.max_trials or 1
    if searcher.name != "adaptive_asha":
        return Brackets(unit, ((total,),), (trials,))
    note = None
    if searcher.bracket_rungs:
        counts = tuple(sorted(searcher.bracket_rungs, reverse=True))
    else:
        top, note = rung_count(searcher, length)
        if searcher.mode == "conservative":
            counts = tuple(range(top, 0, -1))
        elif searcher.mode == "standard":
            counts = tuple(range(top, (top - 1) // 2, -1))
        else:  # aggressive, or not given: dtrain's one bracket
            counts = (top,)
    shares = bracket_trials(trials, searcher.divisor, counts) if len(counts) > 1 else (trials,)
    return Brackets(unit, tuple(rungs(c, searcher.divisor, total) for c in counts), shares, note)


def rung_lengths(searcher: SearcherConfig, length: Length) -> tuple[Unit, tuple[int, ...], str | None]:
    """(unit, rung ends of the largest bracket, note): the last length is a full trial."""
    b = brackets(searcher, length)
    return b.unit, b.lengths[0], b.note


def trials_needed(divisor: int, rungs: int) -> int:
    """Trials for a selection among at least ``divisor`` at every promotion of ``rungs`` rungs."""
    return divisor ** (rungs - 1)


def rungs_for(divisor: int, trials: int) -> int:
    """The most rungs ``trials`` trials make a real selection at (at least 1: no early stopping)."""
    rungs = 1
    while trials_needed(divisor, rungs + 1) <= trials:
        rungs += 1
    return rungs


def too_few_trials(searcher: SearcherConfig, length: Length) -> str | None:
    """A one-line warning when ``adaptive_asha`` runs fewer rungs than ``max_rungs`` because ``max_trials`` is
    too small for them (see the module's docstring), naming how many trials the rungs need; None otherwise.
    ``length``: the training length of a full trial (``searcher.max_length``, else the experiment's)."""
    if searcher.name != "adaptive_asha" or searcher.max_trials is None or searcher.bracket_rungs:
        return None
    _, total = _units(length)
    d, asked, trials = searcher.divisor, searcher.max_rungs, searcher.max_trials
    by_length = _log_floor(total, d) + 1
    fitting = _trial_cap(searcher)
    if fitting >= min(asked, by_length):
        return None
    wanted = min(asked, by_length)
    needed = trials_needed(d, wanted)
    return (f"searcher: max_trials {trials} is too few for adaptive_asha's {wanted} rungs with divisor {d}: keeping "
            f"the best 1/{d} at each rung needs at least {needed} trials ({d}^{wanted - 1}); using {fitting} "
            f"rung(s), as Determined does; raise searcher.max_trials to {needed} for {wanted} rungs")
