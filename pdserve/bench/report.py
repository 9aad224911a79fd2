"""Benchmark results as files: JSON (everything), a markdown table (for docs), a PNG (plot.py).

Formats only; measuring and summarising happen elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.points import Point
from pdserve.bench.stats import Percentiles


def to_json(points: Sequence[Point], *, load_name: str, meta: Mapping[str, Any]) -> str:
    rows = [{"target": point.target, load_name: point.load, **dataclasses.asdict(point.summary)} for point in points]
    return json.dumps({"meta": dict(meta), "load": load_name, "results": rows}, indent=2)


def to_markdown(points: Sequence[Point], *, load_name: str) -> str:
    """A table with one row per target and load: percentiles as p50 / p90 / p99 in ms."""
    header = (f"| target | {load_name} | req/s | out tok/s | TTFT ms p50/p90/p99 | ITL ms p50/p90/p99 "
              "| TPOT ms p50/p90/p99 | goodput req/s | SLO met | errors |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for point in points:
        summary = point.summary
        lines.append(
            f"| {point.target} | {point.load:g} | {summary.request_rate:.2f} | {summary.output_tokens_per_s:.0f} "
            f"| {_triple(summary.ttft_ms)} | {_triple(summary.itl_ms)} | {_triple(summary.tpot_ms)} "
            f"| {summary.goodput:.2f} | {summary.slo_attainment:.0%} | {summary.errors} |"
        )
    return "\n".join(lines) + "\n"


def write_report(
    points: Sequence[Point], *, out_dir: Path, load_name: str, meta: Mapping[str, Any], title: str
) -> list[Path]:
    """Write results.json, results.md and results.png into ``out_dir``; returns their paths."""
    from pdserve.bench.plot import plot  # matplotlib loads slowly: only when a plot is due

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path, png_path = (out_dir / f"results.{suffix}" for suffix in ("json", "md", "png"))
    json_path.write_text(to_json(points, load_name=load_name, meta=meta))
    markdown_path.write_text(to_markdown(points, load_name=load_name))
    plot(points, png_path, load_name=load_name, title=title)
    return [json_path, markdown_path, png_path]


def _triple(percentiles: Percentiles | None) -> str:
    if percentiles is None:
        return "-"
    return f"{percentiles.p50:.1f} / {percentiles.p90:.1f} / {percentiles.p99:.1f}"
