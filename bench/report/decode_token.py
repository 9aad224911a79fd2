"""Renderers of section 8's runs with the decode engine's first token (benchmarks.md): bench.log and ttft-split.txt.

Each folder is one pair's run (bench/gpu/pd_pair.sh): bench.log holds the table `bench run` printed for targets
direct and pd; ttft-split.txt what bench/gpu/ttft_split.py printed from the counters around it.
"""

from __future__ import annotations

import re
from pathlib import Path

from bench.report.raw import read_text
from bench.report.tables import Renderer, fixed, span, table

_LABELS = {
    "prefill": "pd: prefill engine TTFT (its arrival -> its one token)",
    "decode": "pd: decode engine TTFT (arrival -> first token)",
    "queue": "pd: decode engine queue time (incl. waiting for KV)",
    "step": "pd: decode engine prefill time (scheduled -> first token)",
    "total": "pd: gateway TTFT",
    "alone": "direct: decode engine TTFT (arrival -> first token)",
    "nixl": "pd: decode engine NIXL transfer time",
    "nixl_post": "pd: decode engine NIXL post time",
}
_MEAN = re.compile(r"^(?P<part>.+?)\s+n=\s*\d+\s+mean\s+(?P<ms>[\d.]+) ms", re.MULTILINE)


def _bench_log(results_dir: Path, folder: str) -> dict[str, list[str]]:
    """The bench.log table's cells by target."""
    lines = read_text(results_dir / folder / "bench.log").splitlines()
    return {cells[1]: cells for line in lines if len(cells := [cell.strip() for cell in line.split("|")]) > 5}


def _ratios(cells: dict[str, list[str]]) -> tuple[float, float]:
    """PD's TTFT over direct's at p50 and at p99, from the bench.log cells."""
    direct, pd = ([float(q) for q in cells[target][5].split(" / ")] for target in ("direct", "pd"))
    return pd[0] / direct[0], pd[2] / direct[2]


def pairs_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """One row per pair: direct's and PD's TTFT p50/p90/p99, PD over direct at p50 and p99, ITL p50 of each."""
    rows = []
    for folder in folders:
        cells = _bench_log(results_dir, folder)
        itl = [cells[target][6].split(" / ")[0] for target in ("direct", "pd")]
        rows.append([f"[`{folder}`](results/{folder}/bench.log)", cells["direct"][5], cells["pd"][5],
                     "{:.2f}, {:.2f}".format(*_ratios(cells)), ", ".join(itl)])
    return table(["pair (raw)", "direct TTFT ms p50/p90/p99", "PD TTFT ms p50/p90/p99", "PD / direct p50, p99",
                  "ITL p50 direct, PD"], rows)


def best_ratios(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the lowest PD / direct TTFT ratio over the pairs, at p50 and at p99."""
    ratios = [_ratios(_bench_log(results_dir, folder)) for folder in folders]
    return f"p50 {min(p50 for p50, _ in ratios):.2f}x at best, p99 {min(p99 for _, p99 in ratios):.2f}x at best"


def _means(results_dir: Path, folder: str) -> dict[str, float]:
    """Each part of PD TTFT (ms, means over the PD requests) from the folder's ttft-split.txt, by short name."""
    text = read_text(results_dir / folder / "ttft-split.txt")
    means = {m["part"].strip(): float(m["ms"]) for m in _MEAN.finditer(text)}
    parts = {short: means[label] for short, label in _LABELS.items()}
    parts["hops"] = parts["total"] - parts["prefill"] - parts["decode"]
    parts["intake"] = parts["decode"] - parts["queue"] - parts["step"]
    parts["added"] = parts["total"] - parts["alone"]  # what PD adds to one engine alone
    parts["http"] = parts["hops"] + parts["intake"]
    return parts


def split_parts(results_dir: Path, folders: tuple[str, ...]) -> str:
    """The PD TTFT of one run split in parts, means over its PD requests (ms), from its ttft-split.txt."""
    m = _means(results_dir, folders[0])
    rows = [[f"prefill engine, arrival -> its one token (one engine alone: {fixed(m['alone'])} for the whole request)",
             fixed(m["prefill"])],
            ["gateway: prefill leg reply, then the decode leg's request (two HTTP hops of the whole prompt)",
             fixed(m["hops"])],
            ["decode engine, before its engine core has the request and after the token (re-reading the prompt, IPC)",
             fixed(m["intake"])],
            ["decode engine, waiting for the KV pull and the steps around it", f"{fixed(m['queue'])} (NIXL: {fixed(m['nixl'])})"],
            ["decode engine, the step that computes the last prompt token, then the token out", fixed(m["step"])],
            ["**PD TTFT, mean**", f"**{fixed(m['total'])}**"]]
    return table(["part of PD TTFT", "ms"], rows) + f"\n\nRaw: [`{folders[0]}/ttft-split.txt`](results/{folders[0]}/ttft-split.txt)"


def part_ms(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline, ``FOLDER... @PART``: one part's mean (ms) per pair, as a span (PART: a key of ``_means``)."""
    *folders, part = args
    return span([_means(results_dir, folder)[part.removeprefix("@")] for folder in folders], 1, " ms")


RENDERERS: dict[str, Renderer] = {"decode_token_pairs_table": pairs_table, "decode_token_split": split_parts,
                                  "decode_token_best": best_ratios, "decode_token_ms": part_ms}
