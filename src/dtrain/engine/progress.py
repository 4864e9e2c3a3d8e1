"""Console progress on the chief: a rich bar on a terminal, plain lines otherwise (logs, CI, --quiet)."""

from __future__ import annotations

import sys
from collections.abc import Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class ProgressReporter:
    def __init__(self, total_batches: int, start: int, enabled: bool, quiet: bool) -> None:
        self.enabled = enabled
        self.quiet = quiet
        self.total = total_batches
        self._bar: Progress | None = None
        if enabled and not quiet and sys.stdout.isatty():
            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(), console=Console(), transient=False,
            )
            self._task = self._bar.add_task("train", total=total_batches, completed=start, info="")
            self._bar.start()
        self.has_bar = self._bar is not None  # an attribute, not a property: the step loop reads it every step

    def advance(self, batches: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=batches)

    def report(
        self, kind: str, batches: int, epoch: int, metrics: Mapping[str, float], samples_per_s: float | None
    ) -> None:
        if not self.enabled:
            return
        shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        speed = f"  {samples_per_s:,.0f} samples/s" if samples_per_s else ""
        if self._bar is not None:
            if kind == "training":
                self._bar.update(self._task, completed=batches, info=f"{shown}{speed}")
            else:
                self._bar.console.print(f"[cyan]validation[/] @ batch {batches}: {shown}")
        elif not self.quiet:
            print(f"[{kind}] batch {batches}/{self.total} epoch {epoch}  {shown}{speed}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
