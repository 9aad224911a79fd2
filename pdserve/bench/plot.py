"""The results PNG: latency, throughput and goodput against load, one line per target (matplotlib)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure  # no pyplot: no global figure state, no display needed

from pdserve.bench.points import Point
from pdserve.bench.stats import Summary

_PANELS: tuple[tuple[str, Callable[[Summary], float | None]], ...] = (
    ("TTFT p90 (ms)", lambda summary: summary.ttft_ms.p90 if summary.ttft_ms else None),
    ("inter-token p90 (ms)", lambda summary: summary.itl_ms.p90 if summary.itl_ms else None),
    ("output tokens/s", lambda summary: summary.output_tokens_per_s),
    ("goodput (requests/s within SLOs)", lambda summary: summary.goodput),
)

_X_LABELS = {"rate": "offered load (requests/s)", "streams": "concurrent streams"}


def plot(points: Sequence[Point], path: Path, *, load_name: str, title: str) -> None:
    """Write a 2x2 panel figure to ``path``."""
    figure = Figure(figsize=(11, 8))
    axes = figure.subplots(2, 2)
    targets = list(dict.fromkeys(point.target for point in points))
    for axis, (label, value_of) in zip(axes.flat, _PANELS, strict=True):
        values: list[float] = []
        for target in targets:
            mine = sorted((point for point in points if point.target == target), key=lambda point: point.load)
            xy = [(point.load, value_of(point.summary)) for point in mine]
            shown = [(x, y) for x, y in xy if y is not None]
            axis.plot([x for x, _ in shown], [y for _, y in shown], marker="o", label=target)
            values += [y for _, y in shown]
        axis.set_xlabel(_X_LABELS.get(load_name, load_name))
        axis.set_ylabel(label)
        _scale(axis, values)
        axis.grid(alpha=0.3)
    axes.flat[0].legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _scale(axis: Axes, values: list[float]) -> None:
    """Linear from zero, unless the values span more than 30x (one target stalled): then log."""
    positive = [value for value in values if value > 0]
    if positive and max(positive) > 30 * min(positive):
        axis.set_yscale("log")
    else:
        axis.set_ylim(bottom=0)
