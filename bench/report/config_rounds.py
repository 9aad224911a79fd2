"""Renderers of `bench/config_ab.py` output (benchmarks.md section 8, README): two arms, several rounds, rates per row.

The argument is a file pattern under docs/results/ (``*`` allowed; files in name order, rounds in file order).
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from bench.report.raw import read_text
from bench.report.tables import Renderer, fixed, raw_link, span, table

_ARM = re.compile(r"^([^|:\n]+): ready (.*)$", re.MULTILINE)
_READY_S = re.compile(r"(\d+) s")
_ROW = re.compile(r"^\| \w+ \| (?P<rate>[\d.]+) \| [^|]+ \| \d+ \| (?P<ttft_p50>[\d.]+) / [\d.]+ / [\d.]+ "
                  r"\| (?P<itl_p50>[\d.]+) / [\d.]+ / (?P<itl_p99>[\d.]+) \| (?P<tpot_p50>[\d.]+) / [\d.]+ / [\d.]+ "
                  r"\| (?P<goodput>[\d.]+) \|",
                  re.MULTILINE)
_FIGURES = ("ttft_p50", "itl_p50", "itl_p99", "tpot_p50", "goodput", "ready_s")

Figures = dict[str, float]  # one round's ttft_p50, itl_p50, itl_p99, tpot_p50 (ms), goodput (req/s), ready_s
Rounds = dict[str, dict[str, list[Figures]]]  # rate -> arm -> figures per round


def _rounds(results_dir: Path, pattern: str) -> tuple[list[str], Rounds]:
    """Each arm's figures per rate and round over the files; the arms in order of appearance."""
    arms: list[str] = []
    rounds: Rounds = {}
    paths = sorted(results_dir.glob(pattern))
    assert paths, f"no file matches {pattern}"
    for path in paths:
        parts = _ARM.split(read_text(path))  # [preamble, arm, its ready line, its rows, arm, ...]
        for arm, ready, section in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
            arms += [] if arm in arms else [arm]
            ready_s = max(float(seconds) for seconds in _READY_S.findall(ready))
            for row in _ROW.finditer(section):
                per_arm = rounds.setdefault(f"{float(row['rate']):g}", {})
                per_arm.setdefault(arm, []).append({**{key: float(row[key]) for key in _FIGURES[:5]}, "ready_s": ready_s})
    return arms, rounds


def rounds_table(results_dir: Path, args: tuple[str, ...]) -> str:
    """One row per rate: TTFT p50 per round (first arm / second), its ratio two ways, inter-token p99 per round."""
    arms, rounds = _rounds(results_dir, args[0])
    first, second = arms
    header = ["rate", f"TTFT p50 ms, {first} / {second}, per round", "ratio of the medians",
              "median of the per-round ratios", "inter-token p99 ms, per round"]
    rows = []
    for rate, per_arm in rounds.items():
        pairs = list(zip(per_arm[first], per_arm[second], strict=True))
        ttft_a, ttft_b = [a["ttft_p50"] for a, _ in pairs], [b["ttft_p50"] for _, b in pairs]
        lower = sum(a < b for a, b in zip(ttft_a, ttft_b, strict=True))
        rows.append([rate, ", ".join(f"{fixed(a)}/{fixed(b)}" for a, b in zip(ttft_a, ttft_b, strict=True)),
                     f"**{statistics.median(ttft_a) / statistics.median(ttft_b):.2f}**",
                     f"{statistics.median(a / b for a, b in zip(ttft_a, ttft_b, strict=True)):.2f} "
                     + f"({lower} of {len(pairs)} rounds lower)",
                     ", ".join(f"{fixed(a['itl_p99'])}/{fixed(b['itl_p99'])}" for a, b in pairs)])
    return table(header, rows) + f"\n\nRaw: {raw_link(args[0])}, rounds in file order."


def arms_table(results_dir: Path, args: tuple[str, ...]) -> str:
    """One row per rate and arm, each cell the rounds' figures in order."""
    arms, rounds = _rounds(results_dir, args[0])
    rows = []
    for rate, per_arm in rounds.items():
        for arm in arms:
            runs = per_arm[arm]
            rows.append([rate, arm, ", ".join(fixed(r["ready_s"], 0) for r in runs), ", ".join(fixed(r["ttft_p50"], 0) for r in runs),
                         ", ".join(f"{fixed(r['itl_p50'])} / {fixed(r['itl_p99'])}" for r in runs),
                         ", ".join(fixed(r["tpot_p50"]) for r in runs), ", ".join(fixed(r["goodput"], 2) for r in runs)])
    header = ["rate, req/s", "arm", "engines ready, s (the later)", "TTFT p50, ms", "ITL p50 / p99, ms", "TPOT p50, ms",
              "goodput, req/s"]
    link = args[0].rpartition("/")[0] + "/" if "*" in args[0] else args[0]
    return table(header, rows) + f"\n\nRaw: [`{args[0]}`](results/{link}), rounds in file order."


def second_over_first(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline: the second arm's TTFT p50 and inter-token p50 over the first's, as spans over every round and rate."""
    arms, rounds = _rounds(results_dir, args[0])
    first, second = arms
    pairs = [pair for per_arm in rounds.values() for pair in zip(per_arm[first], per_arm[second], strict=True)]
    ratios = {key: [b[key] / a[key] for a, b in pairs] for key in ("itl_p50", "ttft_p50")}
    return (f"{second} against {first}: inter-token p50 {span(ratios['itl_p50'], 2)}x, TTFT p50 "
            f"{span(ratios['ttft_p50'], 2)}x ({len(pairs) // len(rounds)} rounds at {', '.join(rounds)} req/s)")


def arms_at(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline, ``FILE @RATE``: both arms' ready time (the slower engine's) and, at RATE, inter-token p50 and goodput."""
    arms, rounds = _rounds(results_dir, args[0])
    rate = args[1].lstrip("@")
    first, second = (rounds[rate][arm] for arm in arms)

    def both(key: str, digits: int) -> str:
        return f"{span([r[key] for r in first], digits)} against {span([r[key] for r in second], digits)}"

    return (f"{arms[0]} against {arms[1]}: ready in {both('ready_s', 0)} s; at {rate} req/s inter-token p50 "
            f"{both('itl_p50', 1)} ms and goodput {both('goodput', 2)} req/s ({len(first)} rounds)")


RENDERERS: dict[str, Renderer] = {"config_rounds_table": rounds_table, "config_second_over_first": second_over_first,
                                  "config_arms_at": arms_at, "config_arms_table": arms_table}
