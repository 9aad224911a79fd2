"""Renderers of the gateway's A/B runs (bench/gateway_ab.py output) and of run-queue waits (bench/run_queue_waits.py)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from bench.report.raw import read_json, read_text
from bench.report.tables import Renderer, fixed, span

LONG_WAIT_S = 5.0  # a batch whose longest wait passed this stalled, rather than waited a scheduler tick
_WINDOW = re.compile(r"^([AB]) \d+ streams, \d+ worker\(s\): ([\d.]+) us per chunk", re.MULTILINE)


def ab_windows_per_chunk(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the median of every A and every B window's CPU per chunk over the folders' ab-run-*.txt."""
    windows: dict[str, list[float]] = {"A": [], "B": []}
    for folder in folders:
        for path in sorted((results_dir / folder).glob("ab-run-*.txt")):
            for tree, per_chunk in _WINDOW.findall(read_text(path)):
                windows[tree].append(float(per_chunk))
    a, b = statistics.median(windows["A"]), statistics.median(windows["B"])
    return (f"all {len(windows['A'])} windows of each, medians: {fixed(a)} against {fixed(b)} µs "
            f"(**{(b / a - 1) * 100:+.1f}%**)")


def longest_run_queue_waits(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: how many batches' longest run-queue wait passed LONG_WAIT_S, and the spans of both groups (files)."""
    longest = [batch["longest_wait_s"] for folder in folders for batch in read_json(results_dir / folder)["batches"]]
    long = [wait for wait in longest if wait > LONG_WAIT_S]
    short = [wait for wait in longest if wait <= LONG_WAIT_S]
    return (f"{span(long, 1, ' s')} (over {LONG_WAIT_S:g} s) in {len(long)} of {len(longest)} batches and "
            f"{span(short, 3, ' s')} in the others")


RENDERERS: dict[str, Renderer] = {
    "ab_windows_per_chunk": ab_windows_per_chunk,
    "longest_run_queue_waits": longest_run_queue_waits,
}
