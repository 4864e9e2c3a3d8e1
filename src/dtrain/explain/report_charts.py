"""The run report's charts (:mod:`dtrain.explain.report`): PNGs as base64 data URIs, so the page needs no
network and no files beside it."""

from __future__ import annotations

import base64
import io
import math
from typing import Any

from dtrain.explain.render import pyplot
from dtrain.profiling.record import ProfileRecord

PHASE_COLORS = {"data": "#4e79a7", "forward": "#59a14f", "backward": "#8cd17d", "comm_exposed": "#e15759",
                "optimizer": "#f28e2b", "other": "#bab0ac"}


def _png_data_uri(fig: Any) -> str:
    """Save ``fig`` as a PNG data URI and close it (pyplot keeps every open figure alive otherwise)."""
    plt = pyplot()
    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _plain(text: Any) -> str:
    # Matplotlib reads $...$ as TeX; a metric or host name with dollars must not break (or restyle) a chart.
    return str(text).replace("$", r"\$")


def plot_breakdown(profile: ProfileRecord) -> str:
    """Stacked bar, one bar per rank, one segment per phase, in ms per step."""
    plt = pyplot()
    ranks = profile.per_rank
    positions = list(range(len(ranks)))
    fig, ax = plt.subplots(figsize=(max(5.0, 3.0 + 0.9 * len(ranks)), 4.0))
    bottoms = [0.0] * len(ranks)
    for phase in profile.phases:
        heights = [1e3 * r.seconds_per_step.of(phase) for r in ranks]
        ax.bar(positions, heights, bottom=bottoms, label=_plain(phase), color=PHASE_COLORS.get(phase))
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, total in zip(positions, bottoms, strict=True):  # the step total on top of each bar
        ax.annotate(f"{total:.2f}", (x, total), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(positions, [_plain(f"rank {r.rank}\n{r.host or '?'}") for r in ranks])
    ax.set_ylabel("ms per step")
    ax.set_title("Step time per rank")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return _png_data_uri(fig)


def plot_throughput(points: list[tuple[float, float]], profiled_mean: float | None, changes: list[int]) -> str:
    """Samples/s per training report vs batches; the profiled mean, and each membership change, as lines."""
    plt = pyplot()
    mean = profiled_mean if profiled_mean is not None and math.isfinite(profiled_mean) else None
    fig, ax = plt.subplots(figsize=(8.0, 3.5))
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label="training reports")
    if mean is not None:
        ax.axhline(mean, color="#e15759", linestyle="--", linewidth=1, label="profiled mean")
    for i, batch in enumerate(changes):
        ax.axvline(batch, color="#59a14f", linestyle=":", linewidth=1, label="nodes changed" if i == 0 else None)
    ax.set(xlabel="batches", ylabel="samples / s")
    top = max([p[1] for p in points] + ([mean] if mean is not None else []))
    ax.set_ylim(0, 1.1 * top if top > 0 else 1.0)  # from zero, so a small wobble does not look like a collapse
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _png_data_uri(fig)


def plot_curves(series: dict[str, dict[str, tuple[list[float], list[float]]]]) -> str:
    """One subplot per (kind, metric): losses and accuracies have different scales, so they get own axes."""
    plt = pyplot()
    panels = [(kind, name, xy) for kind, metrics in series.items() for name, xy in metrics.items()]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.0 * cols, 3.0 * rows), squeeze=False)
    for ax, (kind, name, (xs, ys)) in zip(axes.flat, panels, strict=False):
        ax.plot(xs, ys, marker="o", markersize=3, color="#4e79a7" if kind == "training" else "#f28e2b")
        ax.set_title(_plain(f"{kind}: {name}"), fontsize=10)
        ax.set_xlabel("batches")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    return _png_data_uri(fig)
