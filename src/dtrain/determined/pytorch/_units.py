"""Training lengths in Determined's units: ``Batch(n)`` and ``Epoch(n)``, as ``Trainer.fit`` takes them."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from dtrain.errors import UserError


class TrainUnit:
    """A length or period: ``value`` batches (:class:`Batch`) or epochs (:class:`Epoch`). A batch is one
    global batch (every slot's ``train_batch`` once), as in Determined."""

    unit = ""

    def __init__(self, value: int | Container[int]) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.value == self.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self.value)))

    def to_length(self, what: str) -> dict[str, int]:
        """The config's form of this length (``{"batches": n}`` or ``{"epochs": n}``); a list of points
        (``Batch([5, 30])``) or a count below 1 is a one-line error naming ``what``."""
        value: Any = self.value
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{what}={self!r}: dtrain's periods are regular, give a whole number "
                            f"({type(self).__name__}(N)), not a list of points")
        if value < 1:
            raise UserError(f"{what}={self!r}: give at least 1 (leave {what} out for never)")
        return {self.unit: value}


class Batch(TrainUnit):
    """``Batch(n)``: n global batches."""

    unit = "batches"


class Epoch(TrainUnit):
    """``Epoch(n)``: n passes over the training data (full global batches only)."""

    unit = "epochs"
