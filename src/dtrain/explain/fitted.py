"""The cost model's fitted constants, read from ``fitted_intervals.json`` beside this module.

``bench/plan_accuracy.py --refit`` writes that file from the stored held-out rows (``bench/data/``) by
leave-one-configuration-out (:mod:`dtrain.explain.calibration`); the cost model reads it once. Each
uncertainty is one relative standard deviation of an input; each term constant prices one effect
(:mod:`dtrain.explain.costmodel`). The file says, per constant, whether rows fitted it or it is assumed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources

FILE = "fitted_intervals.json"
Table = dict[str, dict[str, object]]


@dataclass(frozen=True, slots=True)
class Fitted:
    """Relative uncertainties by input name, and the constants of the model's terms by name."""

    uncertainty: dict[str, float]
    terms: dict[str, float]


def parse(document: dict[str, Table]) -> Fitted:
    """A :class:`Fitted` from the file's JSON document (``{"uncertainty": {name: {"value": x}}, "terms": ...}``)."""
    def values(key: str) -> dict[str, float]:
        return {name: float(str(entry["value"])) for name, entry in document[key].items()}

    return Fitted(values("uncertainty"), values("terms"))


@cache
def _packaged() -> Fitted:
    text = resources.files("dtrain.explain").joinpath(FILE).read_text(encoding="utf-8")
    return parse(json.loads(text))


_trial: list[Fitted] = []


def load() -> Fitted:
    """The constants in force: the packaged file's, or a fit's trial values inside :func:`trying`."""
    return _trial[-1] if _trial else _packaged()


@contextlib.contextmanager
def trying(values: Fitted) -> Iterator[None]:
    """Predict with ``values`` instead of the packaged constants (the fit tries its candidates so)."""
    _trial.append(values)
    try:
        yield
    finally:
        _trial.pop()
