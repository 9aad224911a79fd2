"""Inline figures of two systems' `pdserve bench run` results side by side: ratios, losses, SLO knees, ready times.

Folders come in pairs (system A's results folder, then B's, same load levels; ``FOLDER#TARGET`` picks one target
of a run that measured several; ``*`` names repeated runs, paired in name order); a last argument ``@LOW-HIGH`` keeps only the load levels in that range.
A ratio is A over B.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.report.raw import bench_rows, read_json, read_text
from bench.report.systems import system_of
from bench.report.tables import Renderer, fixed, percent, span, table

_METRICS = {"ttft_p50": ("ttft_ms", "p50"), "ttft_p99": ("ttft_ms", "p99"), "itl_p50": ("itl_ms", "p50"),
            "itl_p90": ("itl_ms", "p90"), "itl_p99": ("itl_ms", "p99"), "tpot_p50": ("tpot_ms", "p50")}
_READY = re.compile(r"ready in (\d+)s|\"ready_s\": ([\d.]+)")

Row = dict[str, Any]


def _pairs(results_dir: Path, args: tuple[str, ...]) -> Iterator[tuple[Row, Row]]:
    """Each load level's rows of A and B, over every pair of folders, within the ``@LOW-HIGH`` range if given."""
    low, high = 0.0, float("inf")
    folders = list(args)
    if folders and folders[-1].startswith("@"):
        low_text, high_text = folders.pop()[1:].split("-")
        low, high = float(low_text), float(high_text)
    for first, second in zip(folders[::2], folders[1::2], strict=True):
        for run_a, run_b in zip(_expand(results_dir, first), _expand(results_dir, second), strict=True):
            for row_a, row_b in zip(_rows(results_dir, run_a), _rows(results_dir, run_b), strict=True):
                if low <= row_a["level"] <= high:
                    yield row_a, row_b


def _expand(results_dir: Path, folder: str) -> list[str]:
    """``folder``, or with ``*`` in it the run folders it names, in name order (run 1 of A beside run 1 of B)."""
    if "*" not in folder:
        return [folder]
    runs = [path.relative_to(results_dir).as_posix() for path in sorted(results_dir.glob(folder))]
    assert runs, f"no folder matches {folder}"
    return runs


def _rows(results_dir: Path, folder: str) -> list[Row]:
    """The folder's results.json rows; ``FOLDER#TARGET``: only that target's, where one run measured several."""
    path, _, target = folder.partition("#")
    return [row for row in bench_rows(results_dir / path) if not target or row["target"] == target]


def _value(row: Row, metric: str) -> float:
    if metric == "goodput":
        return float(row["goodput"])
    key, quantile = _METRICS[metric]
    return float(row[key][quantile])


def ratio(results_dir: Path, args: tuple[str, ...], metric: str) -> str:
    """``low-high x``: A's figure over B's at every level."""
    ratios = [_value(a, metric) / _value(b, metric) for a, b in _pairs(results_dir, args) if _value(b, metric)]
    return span(ratios, 2) + "x" if ratios else "n/a (a figure of 0)"


def higher(results_dir: Path, args: tuple[str, ...], metric: str) -> str:
    """Where A's figure (ms) is higher than B's: by how much, at which levels, and the ratios; "nowhere" if none."""
    lost = [(a["level"], _value(a, metric), _value(b, metric)) for a, b in _pairs(results_dir, args)
            if _value(a, metric) > _value(b, metric)]
    if not lost:
        return "nowhere"
    levels = [level for level, _, _ in lost]
    return (f"{span([a - b for _, a, b in lost])} ms at {span(levels, 0)} req/s "
            f"({span([a / b for _, a, b in lost], 2)}x)")


def against(results_dir: Path, args: tuple[str, ...], metric: str) -> str:
    """``a against b ms at L req/s`` for every level (goodput: req/s)."""
    unit = "req/s" if metric == "goodput" else "ms"
    return "; ".join(f"{fixed(_value(a, metric))} against {fixed(_value(b, metric))} {unit} at {a['level']:g} req/s"
                     for a, b in _pairs(results_dir, args))


_LOWER_BETTER = (("TTFT p50", "ttft_p50"), ("TTFT p99", "ttft_p99"), ("inter-token p99", "itl_p99"),
                 ("inter-token p50", "itl_p50"), ("TPOT p50", "tpot_p50"))


def versus_rows(results_dir: Path, args: tuple[str, ...]) -> str:
    """A table: per figure, B's and A's spans per workload (folder pair), A over B, and where A lost.

    Args: pairs (A's folder, B's folder), one pair per workload; each folder's results.json names its workload.
    """
    pairs = list(zip(args[::2], args[1::2], strict=True))
    workloads = [read_json(results_dir / first.partition("#")[0] / "results.json")["meta"]["workload"]
                 for first, _ in pairs]
    rows = []
    for label, metric in (*_LOWER_BETTER, ("goodput (req/s)", "goodput")):
        per_pair = [list(_pairs(results_dir, pair)) for pair in pairs]
        digits = 2 if metric == "goodput" else 1
        cells = [" · ".join(f"{name} {span([_value(row[side], metric) for row in rows_], digits)}"
                            for name, rows_ in zip(workloads, per_pair, strict=True)) for side in (1, 0)]
        ratios = " · ".join(f"{name} {ratio(results_dir, pair, metric)}" for name, pair in zip(workloads, pairs, strict=True))
        rows.append([label, *cells, ratios, _lost(workloads, per_pair, metric)])
    names = [system_of(results_dir, folder.partition("#")[0]) for folder in pairs[0]]
    header = ["figure", f"{names[1]}, span over rates", f"{names[0]}, span over rates", f"{names[0]} / {names[1]}",
              f"{names[0]} not better at"]
    return table(header, rows)


def _lost(workloads: list[str], per_pair: list[list[tuple[Row, Row]]], metric: str) -> str:
    """The workloads and rates where A's figure is worse than B's (higher; for goodput, lower), or "nowhere"."""
    digits = 2 if metric == "goodput" else 1
    worse = [f"{name} {a['level']:g} req/s ({fixed(_value(a, metric), digits)} against {fixed(_value(b, metric), digits)})"
             for name, rows_ in zip(workloads, per_pair, strict=True) for a, b in rows_
             if (_value(a, metric) < _value(b, metric) if metric == "goodput" else _value(a, metric) > _value(b, metric))]
    return ", ".join(worse) or "nowhere"


def slo_knee(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline, one folder: the highest level with every request in SLO, and the first level below 100%."""
    rows = sorted(_rows(results_dir, args[0]), key=lambda row: row["level"])
    full = [row["level"] for row in rows if row["slo_attainment"] >= 1.0]
    short = [row for row in rows if row["slo_attainment"] < 1.0]
    kept = f"every request in SLO up to {full[-1]:g} req/s" if full else "no level with every request in SLO"
    return kept + (f", {percent(short[0]['slo_attainment'])} at {short[0]['level']:g}" if short else "")


def ready_s(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline: the seconds to ready in the folder's ready.txt (`pdserve up`'s line, or the reference's ``ready_s``)."""
    match = _READY.search(read_text(results_dir / args[0] / "ready.txt"))
    assert match, f"{args[0]}/ready.txt holds no ready time"
    return f"{fixed(float(match.group(1) or match.group(2)), 0)} s"


def _bind(render: Callable[[Path, tuple[str, ...], str], str], metric: str) -> Renderer:
    return lambda results_dir, args: render(results_dir, args, metric)


RENDERERS: dict[str, Renderer] = {
    **{f"ratio_{metric}": _bind(ratio, metric) for metric in (*_METRICS, "goodput")},
    **{f"higher_{metric}": _bind(higher, metric) for metric in _METRICS},
    **{f"against_{metric}": _bind(against, metric) for metric in (*_METRICS, "goodput")},
    "versus_rows": versus_rows,
    "slo_knee": slo_knee,
    "ready_s": ready_s,
}
