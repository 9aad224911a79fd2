"""Renderers of `pdserve bench overhead` output (benchmarks.md section 1, README): the gateway's cost per point.

Each argument is an output file under docs/results/ (its JSON lines hold its points); a last argument
``@STREAMS`` or ``@LOW-HIGH`` keeps only the points at those stream counts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bench.report.raw import read_text
from bench.report.tables import Renderer, fixed, span, table

_WORKERS = re.compile(r"gateway workers (\w+)")
Point = dict[str, Any]
PROXY_TTFT_GOAL_MS = 1.5  # issue #26: PD within 1.5 ms of nginx's TTFT p50 added
PROXY_CPU_GOAL = 1.4  # and within 1.4x its CPU per chunk


def points_of(results_dir: Path, args: tuple[str, ...]) -> list[tuple[str, str, Point]]:
    """Every point of the files, with its file and gateway workers, in order; only those at ``@STREAMS`` if given.

    A file may hold several runs of the command: each run's JSON line follows the line that names its workers.
    """
    patterns, (low, high) = _split(args)
    points = []
    for name in files_of(results_dir, patterns):
        workers = "unknown"
        for line in read_text(results_dir / name).splitlines():
            if named := _WORKERS.search(line):
                workers = named.group(1)
            elif line.startswith('{"points"'):
                points += [(name, workers, point) for point in json.loads(line)["points"]
                           if low <= point["streams"] <= high]
    assert points, f"no point in {args}"
    return points


def _split(args: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[float, float]]:
    """The file patterns, and the stream counts kept: ``@N`` or ``@LOW-HIGH`` as the last argument, else all."""
    files, kept = args, (0.0, float("inf"))
    if args[-1].startswith("@"):
        low, _, high = args[-1][1:].partition("-")
        files, kept = args[:-1], (float(low), float(high or low))
    return files, kept


def files_of(results_dir: Path, patterns: tuple[str, ...]) -> list[str]:
    """The files the patterns (paths under docs/results/, ``*`` allowed) name, each pattern's in natural name order."""
    files = [path.relative_to(results_dir).as_posix() for pattern in patterns
             for path in sorted(results_dir.glob(pattern), key=_natural)]
    assert files, f"no file matches {patterns}"
    return files


def _natural(path: Path) -> list[str | int]:
    """Sort key: run2 before run10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def met(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline: in how many of the points (runs) every goal held."""
    points = [point for _, _, point in points_of(results_dir, args)]
    return f"{sum(bool(point['meets_goal']) for point in points)} of {len(points)} runs"


def _proxy_points(results_dir: Path, args: tuple[str, ...]) -> tuple[list[float], list[float], int]:
    """pdserve PD's TTFT p50 added beyond nginx's (ms) and its CPU per chunk over nginx's, per point; and the runs."""
    patterns, (low, high) = _split(args)
    files = files_of(results_dir, patterns)
    gaps, ratios = [], []
    for name in files:
        last = json.loads(read_text(results_dir / name).strip().splitlines()[-1])
        for nginx, pd in zip(last["nginx"], last["pdserve-pd"], strict=True):
            if low <= nginx["streams"] <= high:
                gaps.append(pd["ttft_p50_added_ms"] - nginx["ttft_p50_added_ms"])
                ratios.append(pd["gateway_cpu_us_per_chunk"] / nginx["gateway_cpu_us_per_chunk"])
    return gaps, ratios, len(files)


def proxy_gap(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline, bench/proxy_reference.py output: pdserve PD's TTFT p50 added and CPU per chunk beside nginx's."""
    gaps, ratios, runs = _proxy_points(results_dir, args)
    return (f"{span(gaps, 2)} ms more TTFT p50 than nginx and {span(ratios, 2)}x its CPU per chunk "
            f"({len(gaps)} points in {runs} runs)")


def proxy_criterion(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline: in how many points issue #26's two halves hold (TTFT p50 <= 1.5 ms more than nginx, CPU <= 1.4x)."""
    gaps, ratios, _ = _proxy_points(results_dir, args)
    ttft_held = sum(gap <= PROXY_TTFT_GOAL_MS for gap in gaps)
    cpu_held = sum(ratio <= PROXY_CPU_GOAL for ratio in ratios)
    return f"the TTFT half holds in {ttft_held} of {len(gaps)} points, the CPU half in {cpu_held} of {len(ratios)}"


def point_figures(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline: TTFT p50 and inter-token p99 added, share of direct tokens/s and CPU per chunk, as spans over points."""
    points = [point for _, _, point in points_of(results_dir, args)]
    return (f"{_signed([p['ttft_p50_added_ms'] for p in points], 2)} ms TTFT p50, "
            f"{_signed([p['itl_p99_added_ms'] for p in points], 2)} ms inter-token p99, "
            f"{span([p['throughput_ratio'] * 100 for p in points])}% of direct tokens/s, "
            f"{span([p['gateway_cpu_us_per_chunk'] for p in points])} µs of gateway CPU per relayed chunk "
            f"({len(points)} measured point{'s' if len(points) > 1 else ''})")


def chunks_per_s(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline: the chunks per second the gateway relayed at the points, as a span."""
    return span([point["chunks_per_s"] for _, _, point in points_of(results_dir, args)], 0) + " relayed chunks/s"


def cores_busy(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline: cores busy through the gateway, the gateway's, the synthetic engines' and the load's summed, per point."""
    totals = [sum(point["cores"]["gateway"].values()) for _, _, point in points_of(results_dir, args)]
    return span(totals, 2)


def _signed(values: list[float], digits: int) -> str:
    low, high = min(values), max(values)
    return f"{low:+.{digits}f}" if f"{low:.{digits}f}" == f"{high:.{digits}f}" else f"{low:+.{digits}f} to {high:+.{digits}f}"


def points_table(results_dir: Path, args: tuple[str, ...]) -> str:
    """One row per file and stream count, each cell the runs' figures in order."""
    groups: dict[tuple[str, str, int], list[Point]] = {}
    for name, workers, point in points_of(results_dir, args):
        groups.setdefault((name, workers, point["streams"]), []).append(point)
    header = ["streams", "gateway workers", "TTFT p50 added ms", "ITL p99 added ms", "tokens/s of direct",
              "gateway µs CPU per chunk", "cores busy: gateway, synthetic engines, load generator", "raw"]
    rows = []
    for (name, workers, streams), points in groups.items():
        busy = [p["cores"]["gateway"] for p in points]
        rows.append([f"{streams:,}", workers,
                     ", ".join(f"{p['ttft_p50_added_ms']:+.2f}" for p in points),
                     ", ".join(f"{p['itl_p99_added_ms']:+.2f}" for p in points),
                     span([p["throughput_ratio"] * 100 for p in points]) + "%",
                     ", ".join(fixed(p["gateway_cpu_us_per_chunk"]) for p in points),
                     ", ".join(span([b[part] for b in busy], 2) for part in ("gateway", "upstream", "loadgen")),
                     f"[`{name}`](results/{name})"])
    return table(header, rows)


_GATEWAYS = re.compile(r"(\d+) gateway\(s\)")


def gateways_table(results_dir: Path, args: tuple[str, ...]) -> str:
    """Gateways on cores of their own: one row per gateway count and stream count, a cell per run (file) of it.

    A run that did not sweep a stream count shows "-" there; goals met counts the runs that did.
    """
    files = files_of(results_dir, args)
    cells: dict[tuple[int, int], dict[str, Point]] = {}
    for name in files:
        for _, _, point in points_of(results_dir, (name,)):
            cells.setdefault((_gateways_of(results_dir, name), point["streams"]), {})[name] = point
    rows = []
    for (gateways, streams), by_file in sorted(cells.items()):
        mine = [by_file.get(name) for name in files if _gateways_of(results_dir, name) == gateways]
        points = [p for p in mine if p]
        rows.append([str(gateways), f"{streams:,}",
                     ", ".join(f"{p['ttft_p50_added_ms']:+.2f}" if p else "-" for p in mine),
                     ", ".join(f"{p['itl_p99_added_ms']:+.2f}" if p else "-" for p in mine),
                     span([p["throughput_ratio"] * 100 for p in points]) + "%",
                     ", ".join(fixed(p["gateway_cpu_us_per_chunk"]) for p in points),
                     ", ".join(fixed(p["cores"]["gateway"]["gateway"], 2) for p in points),
                     f"met {sum(bool(p['meets_goal']) for p in points)} of {len(points)}"])
    header = ["gateways", "streams", "TTFT p50 added, per run (ms)", "ITL p99 added, per run (ms)", "tokens/s of direct",
              "gateway µs CPU per chunk", "gateways' cores busy", "goals"]
    return table(header, rows) + f"\n\nRaw, runs in natural name order: {links(args)}"


def _gateways_of(results_dir: Path, name: str) -> int:
    """How many gateways the run's header line names (1 where it names none)."""
    named = _GATEWAYS.search(read_text(results_dir / name))
    return int(named.group(1)) if named else 1


_PATHS = {"nginx": "nginx", "pdserve-1leg": "pdserve, one leg", "pdserve-pd": "pdserve, PD"}


def proxy_table(results_dir: Path, args: tuple[str, ...]) -> str:
    """bench/proxy_reference.py runs: one row per stream count and path, each cell the figures of the runs that swept it."""
    runs = [json.loads(read_text(results_dir / name).strip().splitlines()[-1]) for name in files_of(results_dir, args)]
    rows = []
    for streams in sorted({point["streams"] for run in runs for point in run["nginx"]}):
        swept = [run for run in runs if any(point["streams"] == streams for point in run["nginx"])]
        nginx = [_at(run["nginx"], streams) for run in swept]
        for path, label in _PATHS.items():
            points = [_at(run[path], streams) for run in swept]
            against = ("" if path == "nginx" else ", ".join(
                f"{p['gateway_cpu_us_per_chunk'] / n['gateway_cpu_us_per_chunk']:.2f}x" for p, n in zip(points, nginx, strict=True)))
            rows.append([f"{streams:,}", label, ", ".join(f"{p['ttft_p50_added_ms']:+.2f}" for p in points),
                         _signed([p["itl_p99_added_ms"] for p in points], 2),
                         span([p["throughput_ratio"] * 100 for p in points]) + "%",
                         ", ".join(fixed(p["gateway_cpu_us_per_chunk"]) for p in points), against])
    header = ["streams", "path", "TTFT p50 added, per run (ms)", "ITL p99 added (ms)", "tokens/s of direct",
              "µs CPU per chunk, per run", "CPU against nginx, per run"]
    return table(header, rows) + f"\n\nRaw, runs in natural name order: {links(args)}"


def relay_share_table(results_dir: Path, args: tuple[str, ...]) -> str:
    """bench/proxy_reference.py runs that report the relay threads' CPU: PD's CPU per chunk, the threads' part, nginx's."""
    rows = []
    for name in files_of(results_dir, args):
        run = json.loads(read_text(results_dir / name).strip().splitlines()[-1])
        for pd, nginx in zip(run["pdserve-pd"], run["nginx"], strict=True):
            if pd.get("relay_thread_cpu_us_per_chunk") is not None:
                rows.append([f"[`{name.rsplit('/', 1)[-1]}`](results/{name})", f"{pd['streams']:,}",
                             fixed(pd["gateway_cpu_us_per_chunk"]), fixed(pd["relay_thread_cpu_us_per_chunk"]),
                             fixed(nginx["gateway_cpu_us_per_chunk"])])
    assert rows, f"no run in {args} reports the relay threads' CPU"
    return table(["run", "streams", "PD µs CPU per chunk", "of it in the relay threads", "nginx µs CPU per chunk"], rows)


def _at(points: list[Point], streams: int) -> Point:
    return next(point for point in points if point["streams"] == streams)


def links(patterns: tuple[str, ...]) -> str:
    """Each raw file pattern as a Markdown link (a pattern links its folder)."""
    return ", ".join(f"[`{pattern}`](results/{pattern.rsplit('/', 1)[0] + '/' if set('*?[') & set(pattern) else pattern})"
                     for pattern in patterns)


RENDERERS: dict[str, Renderer] = {"proxy_table": proxy_table, "proxy_criterion": proxy_criterion,
                                  "overhead_chunks_per_s": chunks_per_s, "overhead_cores_busy": cores_busy,
                                  "gateways_table": gateways_table, "overhead_point": point_figures,
                                  "overhead_table": points_table, "overhead_met": met, "proxy_gap": proxy_gap,
                                  "relay_share_table": relay_share_table}
