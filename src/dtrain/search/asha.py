"""ASHA's rungs, and whether a search has enough trials for the rungs it asks for.

``adaptive_asha`` (as in Determined) trains every trial to the first rung and keeps the best 1/``divisor``
of the trials that finished each rung. Its decisions are Optuna's ``SuccessiveHalvingPruner``'s: when a
trial finishes a rung it goes on if it is in the top ``max(n // divisor, 1)`` of the ``n`` trials that have
finished that rung so far, itself included. So the first trial to finish a rung always goes on, and until a
rung has been finished by ``divisor`` trials, "the best 1/divisor" is the best of fewer than ``divisor``.
Reaching the top of ``r`` rungs through a real selection at every rung takes ``divisor ** (r - 1)`` trials;
with fewer, a trial can train to the full length without having beaten anyone. That is not a fault of
the rung logic but of the search's size, and :func:`too_few_trials` says so before the search starts.

Torch- and Optuna-free: ``dtrain check`` uses it too.
"""

from __future__ import annotations

from typing import Literal

from dtrain.config.schema import Length, SearcherConfig

Unit = Literal["batches", "epochs"]


def rung_lengths(searcher: SearcherConfig, length: Length) -> tuple[Unit, tuple[int, ...], str | None]:
    """(unit, training length at the end of each rung, note): the last length is a full trial. Rung k
    ends at ``first * divisor ** k``; rungs that would be shorter than one unit are dropped (the note
    says so). A single length for every searcher but ``adaptive_asha``."""
    unit: Unit = "batches" if length.batches is not None else "epochs"
    total = int(length.batches if length.batches is not None else length.epochs)  # type: ignore[arg-type]
    if searcher.name != "adaptive_asha" or searcher.max_rungs <= 1:
        return unit, (total,), None
    d = searcher.divisor
    fits = 1  # rungs whose first one is at least one unit long: d ** (fits - 1) <= total
    while fits < searcher.max_rungs and d ** fits <= total:
        fits += 1
    note = None
    if fits < searcher.max_rungs:
        note = (f"searcher.max_rungs {searcher.max_rungs} would make the first rung shorter than one {unit[:-1]} "
                f"of {total}; using {fits} rung(s)")
    first = total // d ** (fits - 1)
    return unit, (*(first * d ** k for k in range(fits - 1)), total), note


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
    """A one-line warning when ``adaptive_asha``'s ``max_trials`` is too small for its rungs (see the module's
    docstring), naming how many trials the rungs need and what to change; None otherwise. ``length``: the
    training length of a full trial (``searcher.max_length``, else the experiment's)."""
    if searcher.name != "adaptive_asha" or searcher.max_trials is None:
        return None
    _, lengths, _ = rung_lengths(searcher, length)
    d, rungs, trials = searcher.divisor, len(lengths), searcher.max_trials
    needed = trials_needed(d, rungs)
    if rungs <= 1 or trials >= needed:
        return None
    fitting = rungs_for(d, trials)
    lower = (f"lower searcher.max_rungs to {fitting}" if fitting > 1
             else "use searcher.name: random (no early stopping)")
    return (f"searcher: max_trials {trials} is too few for adaptive_asha's {rungs} rungs with divisor {d}: keeping "
            f"the best 1/{d} at each rung needs at least {needed} trials ({d}^{rungs - 1}); with fewer, a rung "
            f"promotes from fewer than {d} trials (the first to finish a rung always goes on), so a poor trial can "
            f"train to the full length; raise searcher.max_trials to {needed}, or {lower}")
