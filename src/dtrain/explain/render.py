"""Rendering shared by the CLI's tables (rich, as text) and PNG figures (matplotlib, headless)."""

from __future__ import annotations

from io import StringIO
from typing import Any


def as_text(renderable: Any, width: int = 120) -> str:
    """A rich table (or any renderable) as plain text, for the terminal and for files."""
    from rich.console import Console

    buffer = StringIO()
    Console(file=buffer, width=width, force_terminal=False).print(renderable)
    return buffer.getvalue()


def ratio(value: float) -> str:
    """A gain as the tables print it: two decimals, and two significant digits below 0.1, where two decimals
    would print a 30x slow-down and a 60x one alike as 0.03 (bf16 autocast on a CPU without bf16 units)."""
    return f"{value:.2g}" if 0 < abs(value) < 0.1 else f"{value:.2f}"


def interval(bounds: tuple[float, float]) -> str:
    """An 80% interval of a gain as the verdict and the run's closing lines print it."""
    return f"{bounds[0]:.2f}-{bounds[1]:.2f}x at 80%"


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: figures render without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
