"""Renderers of `pdserve bench run/compare` output (benchmarks.md sections 2-4): results.json rows, compare.log's KV line."""

from __future__ import annotations

import re
from pathlib import Path

from bench.report.raw import bench_rows, read_text
from bench.report.tables import Renderer, fixed, percent, percentiles, raw_link, table

_HEADER = ("target", "rate", "req/s", "out tok/s", "TTFT ms p50/p90/p99", "ITL ms p50/p90/p99", "TPOT ms p50/p90/p99",
           "goodput req/s", "SLO met", "errors", "raw")


def results_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """One row per target and load level of each folder's results.json, in the file's order."""
    rows = [[row["target"], f"{row['level']:g}", fixed(row["request_rate"], 2), fixed(row["output_tokens_per_s"], 0),
             percentiles(row, "ttft_ms"), percentiles(row, "itl_ms"), percentiles(row, "tpot_ms"),
             fixed(row["goodput"], 2), percent(row["slo_attainment"]), str(row["errors"]),
             f"[`{folder}`](results/{folder}/results.json)"]
            for folder in folders for row in bench_rows(results_dir / folder)]
    return table(_HEADER, rows)


def pd_direct_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """One row per `bench compare` run of targets direct and disaggregated: TTFT, PD over direct, the KV rate."""
    rows = []
    for folder in folders:
        by_target = {row["target"]: row for row in bench_rows(results_dir / folder)}
        direct, pd = by_target["direct"], by_target["disaggregated"]
        ratios = " / ".join(f"{pd['ttft_ms'][q] / direct['ttft_ms'][q]:.2f}" for q in ("p50", "p90", "p99"))
        rows.append([raw_link(folder), str(pd["requests"]), fixed(direct["ttft_ms"]["p50"]), percentiles(pd, "ttft_ms"),
                     ratios, compare_kv(results_dir, (folder,))])
    header = ["run", "PD requests", "one engine alone, TTFT ms p50", "PD TTFT ms p50 / p90 / p99",
              "PD / one engine alone, p50 / p90 / p99", "KV over the run (decode engine's counters)"]
    return table(header, rows)


_KV_LINE = re.compile(r"KV handoff over the sweep \(decode engines' own counters\): (\d+) transfers, ([\d.]+) (MB|GB) "
                      r"in ([\d.]+) s = ([\d.]+) GB/s, (\d+) failed")


_SEEN = re.compile(r"KV handoff as requests saw it \(gateway: prefill done -> first decoded token, (\d+) requests\): "
                   r"mean ([\d.]+) ms, ([\d.]+) MB each = [\d.]+ GB/s; p50 ([\d.]+) / p90 [\d.]+ / p99 ([\d.]+) ms")


def _log(results_dir: Path, folder: str) -> tuple[str, str]:
    """The text `bench compare` printed (summary.txt where kept, else compare.log), and its name."""
    name = "summary.txt" if (results_dir / folder / "summary.txt").exists() else "compare.log"
    return read_text(results_dir / folder / name), name


def compare_handoff(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the KV handoff as the gateway saw it (prefill done -> first decoded token), as `bench compare` printed."""
    text, name = _log(results_dir, folders[0])
    match = _SEEN.search(text)
    assert match, f"{folders[0]}/{name} holds no handoff line"
    requests, mean_ms, size_mb, p50_ms, p99_ms = match.groups()
    return (f"{requests} handoffs of {size_mb} MB, prefill done to first decoded token mean {mean_ms} ms (p50 {p50_ms}, "
            f"p99 {p99_ms} ms, from histogram buckets: [{name}](results/{folders[0]}/{name}))")


def compare_kv(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the KV rate `bench compare` logged from the decode engines' counters, with its parts."""
    text, name = _log(results_dir, folders[0])
    match = _KV_LINE.search(text)
    assert match, f"{folders[0]}/{name} holds no KV line"
    transfers, size, unit, seconds, gbps, failed = match.groups()
    size_gb = float(size) / (1000 if unit == "MB" else 1)
    return (f"{gbps} GB/s ({transfers} transfers, {fixed(size_gb)} GB in {seconds} s, "
            f"{failed} failed: [{name}](results/{folders[0]}/{name}))")


RENDERERS: dict[str, Renderer] = {"results_table": results_table, "compare_kv": compare_kv,
                                  "compare_handoff": compare_handoff, "pd_direct_table": pd_direct_table}
