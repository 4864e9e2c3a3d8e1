"""The cost model's fitted constants, read from ``fitted_intervals.json`` beside this module.

``bench/plan_accuracy.py --refit`` writes that file from the stored held-out rows (``bench/data/``) by
leave-one-configuration-out (:mod:`dtrain.explain.calibration`); the cost model reads it once. Each
uncertainty is one relative standard deviation of an input; each term constant prices one effect
(:mod:`dtrain.explain.costmodel`). The file says, per constant, whether rows fitted it or it is assumed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

FILE = "fitted_intervals.json"


@dataclass(frozen=True, slots=True)
class Fitted:
    """Relative uncertainties by input name, and the constants of the model's terms by name."""

    uncertainty: dict[str, float]
    terms: dict[str, float]
    fitted: tuple[str, ...]  # the names the stored rows fitted (the others: assumed, said so in the file)


def parse(document: dict[str, object]) -> Fitted:
    """A :class:`Fitted` from the file's JSON document."""
    def numbers(key: str) -> dict[str, float]:
        table = document[key]
        assert isinstance(table, dict)
        return {str(name): float(entry["value"]) for name, entry in table.items()}

    uncertainty, terms = numbers("uncertainty"), numbers("terms")
    fitted = tuple(name for key in ("uncertainty", "terms") for name, entry in document[key].items()  # type: ignore[attr-defined]
                   if str(entry.get("source", "")).startswith("fitted"))
    return Fitted(uncertainty, terms, fitted)


@cache
def load() -> Fitted:
    """The packaged constants (read once)."""
    text = resources.files("dtrain.explain").joinpath(FILE).read_text(encoding="utf-8")
    return parse(json.loads(text))
