"""Renderers of `bench/ray_compare.py` output (benchmarks.md section 6): pdserve on Ray against Ray Serve LLM, CPU.

The folder holds results.json: each system's runs (one per round), each with its ready time and one point per
stream count. A cell is the mean of the rounds, then each round.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report.manifest import load_manifest, settings_note
from bench.report.raw import read_json
from bench.report.tables import Renderer, fixed, span, table

Figure = Callable[[dict[str, Any], int], float]  # (a run, streams) -> the row's figure


def _runs(results_dir: Path, folder: str) -> tuple[dict[str, list[dict[str, Any]]], list[int], list[float]]:
    """Each system's runs in round order, the stream counts, and `pdserve up`'s own ready times."""
    raw = read_json(results_dir / folder / "results.json")
    runs: dict[str, list[dict[str, Any]]] = {}
    for run in sorted(raw["runs"], key=lambda run: run["round"]):
        runs.setdefault(run["system"], []).append(run)
    return runs, list(raw["plan"]["streams"]), list(raw["pdserve_up_ready_s"])


def _point(run: dict[str, Any], streams: int) -> dict[str, Any]:
    return next(point for point in run["points"] if point["streams"] == streams)


def _ready(run: dict[str, Any], _: int) -> float:
    return float(run["ready_s"])


def _quantile(key: str, quantile: str) -> Figure:
    return lambda run, streams: float(_point(run, streams)[key][quantile])


_TTFT, _ITL = _quantile("ttft_ms", "p50"), _quantile("itl_ms", "p99")


def _rows(streams: list[int]) -> list[tuple[str, Figure, int]]:
    """Each row's label, figure and stream count."""
    rows: list[tuple[str, Figure, int]] = [("time to ready, s (deploy command -> first answer)", _ready, 0)]
    for count in streams:
        rows += [(f"TTFT p50, ms, {count} stream(s)", _TTFT, count),
                 (f"inter-token p99, ms, {count} stream(s)", _ITL, count)]
    return rows


def _cell(values: list[float], digits: int = 1) -> str:
    return f"**{fixed(statistics.mean(values), digits)}** ({', '.join(fixed(v, digits) for v in values)})"


def compare_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """The rows of section 6: ready time, TTFT p50 and inter-token p99 per stream count, tokens/s, ratios."""
    runs, streams, up_ready = _runs(results_dir, folders[0])
    ours, theirs = runs["pdserve"], runs["ray-serve-llm"]
    rows = []
    for label, figure, count in _rows(streams):
        a, b = [figure(run, count) for run in ours], [figure(run, count) for run in theirs]
        ratios = ", ".join(f"{x / y:.2f}" for x, y in zip(a, b, strict=True))
        rows.append([label, _cell(a), _cell(b), f"**{statistics.mean(a) / statistics.mean(b):.2f}** ({ratios})"])
    tokens = [" / ".join(", ".join(fixed(_point(run, c)["output_tokens_per_s"], 0) for run in system) for c in streams)
              for system in (ours, theirs)]
    rows.append([f"output tokens/s, {' / '.join(map(str, streams))} stream(s)", *tokens, ""])
    rows.append(["`pdserve up` on this host, time to ready, s", _cell(up_ready), "", ""])
    note = settings_note(load_manifest(results_dir, folders[0]), ["pdserve", "ray-serve-llm"],
                         source=f"docs/results/{folders[0]}/manifest.json")
    return table(["row", "pdserve on Ray", "ray-serve-llm", "pdserve / ray-serve-llm: of the means (per round)"],
                 rows) + "\n\n" + note


def compare_ratios(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: pdserve over Ray Serve LLM per row, as spans over the rounds, and its tokens/s against theirs."""
    runs, streams, _ = _runs(results_dir, folders[0])
    ours, theirs = runs["pdserve"], runs["ray-serve-llm"]
    pairs = list(zip(ours, theirs, strict=True))
    ready = [_ready(a, 0) / _ready(b, 0) for a, b in pairs]
    ttft, itl, tokens = ([figure(a, c) / figure(b, c) for c in streams for a, b in pairs]
                         for figure in (_TTFT, _ITL, _tokens_per_s))
    return (f"time to ready {span(ready, 2)}x, TTFT p50 {span(ttft, 2)}x, inter-token p99 {span(itl, 2)}x, "
            f"{span(tokens, 1)}x the output tokens/s (each round, {' and '.join(map(str, streams))} streams)")


def _tokens_per_s(run: dict[str, Any], streams: int) -> float:
    return float(_point(run, streams)["output_tokens_per_s"])


RENDERERS: dict[str, Renderer] = {"ray_compare_table": compare_table, "ray_compare_ratios": compare_ratios}
