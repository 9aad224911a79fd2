"""Renderers of gateways on cores of their own (benchmarks.md section 1): one gateway's knee beside two gateways' per call.

Each argument is a pattern of one-gateway output files under docs/results/ ("...one-gateway*.txt"), rows in argument
order; a call's two-gateway file, where it ran, is the same name with "two-gateways" for "one-gateway". A knee is the
highest stream count at which every run of it and of every lower count met the three goals (`pdserve bench overhead`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.report.overhead import Point, files_of, links, points_of
from bench.report.tables import Renderer, table


@dataclass(frozen=True, slots=True)
class Sweep:
    """One gateway count's runs in one call, by stream count, lowest first."""

    runs: dict[int, list[Point]]

    @property
    def knee(self) -> int | None:
        held = None
        for streams, points in self.runs.items():
            if not all(point["meets_goal"] for point in points):
                break
            held = streams
        return held

    @property
    def first_missed(self) -> int | None:
        return next((streams for streams, points in self.runs.items()
                     if not all(point["meets_goal"] for point in points)), None)

    @property
    def top(self) -> int:
        return max(self.runs)


def _sweep(results_dir: Path, name: str) -> Sweep | None:
    if not (results_dir / name).exists():
        return None
    runs: dict[int, list[Point]] = {}
    for _, _, point in points_of(results_dir, (name,)):
        runs.setdefault(point["streams"], []).append(point)
    return Sweep(dict(sorted(runs.items())))


def _calls(results_dir: Path, patterns: tuple[str, ...]) -> list[tuple[str, Sweep, Sweep | None]]:
    """Each one-gateway file's call label, its sweep and the call's two-gateway sweep (None: not run), in args order."""
    calls = []
    for name in files_of(results_dir, patterns):
        label = name.rsplit("/", 1)[-1].removesuffix(".txt").replace("one-core-call", "").replace("one-gateway", "")
        one = _sweep(results_dir, name)
        assert one is not None
        calls.append((" ".join(label.replace("-", " ").split()), one,
                      _sweep(results_dir, name.replace("one-gateway", "two-gateways"))))
    return calls


def _figures(points: list[Point], key: str) -> str:
    return " and ".join(f"{point[key]:+.2f}" for point in points)


def _knee(sweep: Sweep) -> str:
    if sweep.knee is None:
        return "below the sweep"
    top = " (the top)" if sweep.knee == sweep.top else ""
    return f"{sweep.knee:,}{top}, {_figures(sweep.runs[sweep.knee], 'ttft_p50_added_ms')} ms"


def _missed(sweep: Sweep) -> str:
    if sweep.first_missed is None:
        return "not reached"
    points = sweep.runs[sweep.first_missed]
    busy = " and ".join(f"{point['cores']['gateway']['gateway']:.2f}" for point in points)
    return (f"{sweep.first_missed:,} (TTFT {_figures(points, 'ttft_p50_added_ms')} ms, "
            f"ITL {_figures(points, 'itl_p99_added_ms')} ms; gateways' cores {busy} busy)")


def _ratio(one: Sweep, two: Sweep | None) -> str:
    if two is None or one.knee is None or two.knee is None:
        return "not both found"
    top = " or more" if two.knee == two.top else ""
    return f"{two.knee / one.knee:.1f}x{top}"


def knees_table(results_dir: Path, args: tuple[str, ...]) -> str:
    """One row per one-gateway file: both knees, the TTFT p50 added there, the first point missed, the ratio."""
    rows = [[label, _knee(one), _missed(one), _knee(two) if two else "not run", _missed(two) if two else "",
             _ratio(one, two)] for label, one, two in _calls(results_dir, args)]
    header = ["call", "one gateway: knee, TTFT p50 added there", "first point missed", "two gateways: knee, TTFT p50 added there",
              "first point missed", "ratio of knees"]
    return table(header, rows) + f"\n\nRaw: {links(args)}, each call's two-gateway file beside its one-gateway file"


def knees_doubled(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline: in how many of the calls that found both knees two gateways held twice one's streams, and which."""
    both = [(label, one, two) for label, one, two in _calls(results_dir, args)
            if two is not None and one.knee is not None and two.knee is not None]
    doubled = [label for label, one, two in both if two.knee >= 2 * one.knee]  # type: ignore[operator]
    return f"{len(doubled)} of the {len(both)} calls that found both knees (calls {', '.join(doubled)})"


RENDERERS: dict[str, Renderer] = {"knees_table": knees_table, "knees_doubled": knees_doubled}
