"""Inline figures of `bench/gateway_ab.py` output (benchmarks.md section 1): the two trees' medians side by side.

Argument: the output file under docs/results/, then optionally ``#N``, the file's Nth A/B summary (1-based) where
one file holds several runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from statistics import median

from bench.report.raw import read_text
from bench.report.tables import Renderer, table

_MEDIAN = re.compile(r"^([AB]) \(.*?\): median ([\d.]+) us per chunk(?:, [\d.]+ us per request)?(?:, TTFT p50 ([\d.]+) ms)? over (\d+) windows",
                     re.MULTILINE)
_WINDOW_TTFT = re.compile(r"^([AB]) \d+ streams, .*?TTFT p50 ([\d.]+) ms", re.MULTILINE)
_WINDOW = re.compile(r"^([AB]) \d+ streams, .*?: ([\d.]+) us per chunk, .*?TTFT p50 ([\d.]+) ms", re.MULTILINE)
_LOAD = re.compile(r"^machine at the (start|end): .*?load average ([\d.]+),", re.MULTILINE)
_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d):\d\d UTC")


def ab_medians(results_dir: Path, args: tuple[str, ...]) -> str:
    """``a -> b µs of gateway CPU per chunk, TTFT p50 a -> b ms (medians of N windows), [raw](file)``."""
    name, index = args[0], int(args[1].lstrip("#")) if len(args) > 1 else 1
    text = read_text(results_dir / name)
    summaries = _MEDIAN.findall(text)
    (side_a, cpu_a, ttft_a, windows), (side_b, cpu_b, ttft_b, _) = summaries[2 * index - 2:2 * index]
    assert (side_a, side_b) == ("A", "B"), f"{name}: summary {index} is not an A/B pair"
    if not ttft_a and len(summaries) == 2:
        ttft_a, ttft_b = (_window_median(text, side) for side in "AB")
    ttft = f", TTFT p50 {ttft_a} -> {ttft_b} ms" if ttft_a else ""
    return f"{cpu_a} -> {cpu_b} µs of gateway CPU per chunk{ttft} (median{'s' if windows != '1' else ''} of {windows} window{'s' if windows != '1' else ''}; [raw](results/{name}))"


def ab_runs(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline, one folder's ab-run-*.txt in natural order: each run's A/B medians of CPU per chunk, B over A, and
    in how many runs B stayed within +10%."""
    runs = sorted((results_dir / args[0]).glob("ab-run-*.txt"), key=lambda path: int(path.stem.rsplit("-", 1)[1]))
    medians = [{side: float(cpu) for side, cpu, _, _ in _MEDIAN.findall(read_text(path))} for path in runs]
    ratios = [run["B"] / run["A"] for run in medians]
    pairs = ", ".join(f"{run['A']:.1f}/{run['B']:.1f}" for run in medians)
    return (f"{pairs} µs, **B/A {', '.join(f'{ratio:.2f}' for ratio in ratios)}**: within +10% in "
            f"{sum(ratio <= 1.10 for ratio in ratios)} of {len(ratios)} runs ([raw](results/{args[0]}/))")


def ab_windows_table(results_dir: Path, args: tuple[str, ...]) -> str:
    """One folder's run-*.txt (gateway_ab.py, one A/B comparison each): per run, its start, the 1-minute load average
    at start and end, the medians of each tree's windows (CPU per chunk, TTFT p50) and B over A; then every window of
    every run pooled, each tree's median."""
    runs = sorted((results_dir / args[0]).glob("run-*.txt"), key=lambda path: int(path.stem.rsplit("-", 1)[1]))
    rows, pooled = [], {"A": ([], []), "B": ([], [])}  # side -> (CPU per chunk, TTFT p50) of every window
    for path in runs:
        text = read_text(path)
        windows = {"A": ([], []), "B": ([], [])}
        for side, cpu, ttft in _WINDOW.findall(text):
            for into in (windows[side], pooled[side]):
                into[0].append(float(cpu))
                into[1].append(float(ttft))
        loads = dict(_LOAD.findall(text))
        stamp = _STAMP.search(text)
        rows.append([f"[{path.stem}](results/{args[0]}/{path.name})", stamp.group(1) if stamp else "?",
                     f"{loads.get('start', '?')} → {loads.get('end', '?')}", *_sides(windows)])
    rows.append(["all windows pooled", "", "", *_sides(pooled)])
    return table(["run", "start (UTC)", "load average", "CPU µs per chunk A / B", "B/A", "TTFT p50 ms A / B", "B/A"],
                 rows)


def _sides(windows: dict[str, tuple[list[float], list[float]]]) -> list[str]:
    """Each tree's window medians, CPU then TTFT, with B over A."""
    (cpu_a, ttft_a), (cpu_b, ttft_b) = ((median(cpu), median(ttft)) for cpu, ttft in (windows["A"], windows["B"]))
    return [f"{cpu_a:.1f} / {cpu_b:.1f}", f"**{cpu_b / cpu_a:.3f}**", f"{ttft_a:.2f} / {ttft_b:.2f}",
            f"**{ttft_b / ttft_a:.3f}**"]


def _window_median(text: str, side: str) -> str:
    """The median TTFT p50 of one side's windows, where the summary line gives none."""
    values = [float(ttft) for window_side, ttft in _WINDOW_TTFT.findall(text) if window_side == side]
    return f"{median(values):.2f}" if values else ""


RENDERERS: dict[str, Renderer] = {"ab_medians": ab_medians, "ab_runs": ab_runs, "ab_windows_table": ab_windows_table}
