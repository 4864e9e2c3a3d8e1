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


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: figures render without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
