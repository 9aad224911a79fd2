"""Renderers of section 8's runs with the decode engine's first token (benchmarks.md): bench.log and ttft-split.txt.

Each folder is one pair's run (bench/gpu/pd_pair.sh): bench.log holds the table `bench run` printed for targets
direct and pd; ttft-split.txt what bench/gpu/ttft_split.py printed from the counters around it.
"""

from __future__ import annotations

import re
from pathlib import Path

from bench.report.raw import read_text
from bench.report.tables import Renderer, fixed, table

_MEAN = re.compile(r"^(?P<part>.+?)\s+n=\s*\d+\s+mean\s+(?P<ms>[\d.]+) ms", re.MULTILINE)


def _bench_log(results_dir: Path, folder: str) -> dict[str, list[str]]:
    """The bench.log table's cells by target."""
    lines = read_text(results_dir / folder / "bench.log").splitlines()
    return {cells[1]: cells for line in lines if len(cells := [cell.strip() for cell in line.split("|")]) > 5}


def pairs_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """One row per pair: direct's and PD's TTFT p50/p90/p99, PD over direct at p50 and p99, ITL p50 of each."""
    rows = []
    for folder in folders:
        cells = _bench_log(results_dir, folder)
        direct, pd = ([float(q) for q in cells[target][5].split(" / ")] for target in ("direct", "pd"))
        itl = [cells[target][6].split(" / ")[0] for target in ("direct", "pd")]
        rows.append([f"[`{folder}`](results/{folder}/bench.log)", cells["direct"][5], cells["pd"][5],
                     f"{pd[0] / direct[0]:.2f}, {pd[2] / direct[2]:.2f}", ", ".join(itl)])
    return table(["pair (raw)", "direct TTFT ms p50/p90/p99", "PD TTFT ms p50/p90/p99", "PD / direct p50, p99",
                  "ITL p50 direct, PD"], rows)


def split_parts(results_dir: Path, folders: tuple[str, ...]) -> str:
    """The PD TTFT of one run split in parts, means over its PD requests (ms), from its ttft-split.txt."""
    text = read_text(results_dir / folders[0] / "ttft-split.txt")
    means = {m["part"].strip(): float(m["ms"]) for m in _MEAN.finditer(text)}
    prefill = means["pd: prefill engine TTFT (its arrival -> its one token)"]
    decode = means["pd: decode engine TTFT (arrival -> first token)"]
    queue = means["pd: decode engine queue time (incl. waiting for KV)"]
    step = means["pd: decode engine prefill time (scheduled -> first token)"]
    total = means["pd: gateway TTFT"]
    alone = fixed(means["direct: decode engine TTFT (arrival -> first token)"])
    rows = [[f"prefill engine, arrival -> its one token (one engine alone: {alone} for the whole request)", fixed(prefill)],
            ["gateway: prefill leg reply, then the decode leg's request (two HTTP hops of the whole prompt)",
             fixed(total - prefill - decode)],
            ["decode engine, before its engine core has the request and after the token (re-reading the prompt, IPC)",
             fixed(decode - queue - step)],
            ["decode engine, waiting for the KV pull and the steps around it",
             f"{fixed(queue)} (NIXL: {fixed(means['pd: decode engine NIXL transfer time'])})"],
            ["decode engine, the step that computes the last prompt token, then the token out", fixed(step)],
            ["**PD TTFT, mean**", f"**{fixed(total)}**"]]
    return table(["part of PD TTFT", "ms"], rows) + f"\n\nRaw: [`{folders[0]}/ttft-split.txt`](results/{folders[0]}/ttft-split.txt)"


RENDERERS: dict[str, Renderer] = {"decode_token_pairs_table": pairs_table, "decode_token_split": split_parts}
