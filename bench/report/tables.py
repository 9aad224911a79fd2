"""Markdown tables and number formats shared by every renderer; pure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def fixed(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def percentiles(summary: dict[str, Any], key: str, digits: int = 1) -> str:
    """``p50 / p90 / p99`` of one of a results.json row's percentile fields."""
    return " / ".join(fixed(summary[key][p], digits) for p in ("p50", "p90", "p99"))


def percent(share: float) -> str:
    return f"{share * 100:.0f}%"


def span(values: Sequence[float], digits: int = 1, unit: str = "") -> str:
    """``low-high`` of ``values`` (one value alone when they round the same)."""
    low, high = fixed(min(values), digits), fixed(max(values), digits)
    return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"


def raw_link(path: str) -> str:
    """A raw file or folder under docs/results/ as a Markdown link from a doc in docs/ (a pattern links its folder)."""
    target = path.rsplit("/", 1)[0] + "/" if set("*?[") & set(path) else path
    return f"[`{path}`](results/{target})"


def ratio(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}x"


Renderer = Callable[[Path, tuple[str, ...]], str]  # (docs/results/, the block's folders) -> Markdown
