"""Renderers of the side-by-side sections (benchmarks.md section 5): systems compared on the same workload."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from bench.report.raw import (
    archived_text,
    bench_rows,
    gateway_request_times,
    kv_windows,
    metric_sum,
    read_json,
    read_text,
)
from bench.report.systems import note_for, system_of
from bench.report.tables import Renderer, fixed, percent, percentiles, raw_link, span, table

_SWEEP_HEADER = ("system", "rate", "req/s", "TTFT ms p50/p90/p99", "ITL ms p50/p90/p99", "TPOT ms p50/p90/p99",
                 "goodput req/s", "SLO met", "raw")
_VERSUS = (("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"), ("inter-token p90", "itl_ms", "p90"),
           ("TPOT p50", "tpot_ms", "p50"))


def sweep_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """One row per system and load level (each folder a results.json), levels interleaved; then the settings."""
    rows = []
    for position, folder in enumerate(folders):
        system = system_of(results_dir, folder)
        rows += [(row["level"], position, _sweep_row(system, row, folder)) for row in bench_rows(results_dir / folder)]
    ordered = [row for _, _, row in sorted(rows, key=lambda entry: (entry[0], entry[1]))]
    return table(_SWEEP_HEADER, ordered) + "\n\n" + note_for(results_dir, folders)


def _sweep_row(system: str, row: dict[str, Any], folder: str) -> list[str]:
    return [system, f"{row['level']:g}", fixed(row["request_rate"], 2), percentiles(row, "ttft_ms"),
            percentiles(row, "itl_ms"), percentiles(row, "tpot_ms"), fixed(row["goodput"], 2),
            percent(row["slo_attainment"]), raw_link(folder)]


def versus_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """System A against B per workload and rate: folders in pairs (A's results, B's results), lower in bold."""
    pairs = list(zip(folders[::2], folders[1::2], strict=True))
    names = [system_of(results_dir, folder) for folder in pairs[0]]
    header = ["workload", "rate (req/s)", *(f"{label} ms, {' · '.join(names)}" for label, _, _ in _VERSUS),
              "in SLO", "raw"]
    rows = []
    for first, second in pairs:
        workload = read_json(results_dir / first / "results.json")["meta"]["workload"]
        for row_a, row_b in zip(bench_rows(results_dir / first), bench_rows(results_dir / second), strict=True):
            cells = [_pair(row_a[key][p], row_b[key][p]) for _, key, p in _VERSUS]
            rows.append([workload, f"{row_a['level']:g}", *cells,
                         f"{percent(row_a['slo_attainment'])} · {percent(row_b['slo_attainment'])}",
                         f"{raw_link(first)}, {raw_link(second)}"])
    return table(header, rows) + "\n\n" + note_for(results_dir, folders)


def _pair(value_a: float, value_b: float) -> str:
    cell_a, cell_b = fixed(value_a), fixed(value_b)
    if value_a < value_b:
        cell_a = f"**{cell_a}**"
    elif value_b < value_a:
        cell_b = f"**{cell_b}**"
    return f"{cell_a} · {cell_b} ({value_a / value_b:.2f}x)"


def versus_not_won(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: every cell of versus_table where the first system's figure is higher, ``name at R req/s (a against b ms)``."""
    losses = []
    for first, second in zip(folders[::2], folders[1::2], strict=True):
        workload = read_json(results_dir / first / "results.json")["meta"]["workload"]
        for row_a, row_b in zip(bench_rows(results_dir / first), bench_rows(results_dir / second), strict=True):
            losses += [f"{workload} {label} at {row_a['level']:g} req/s ({fixed(row_a[key][p])} against "
                       f"{fixed(row_b[key][p])} ms)"
                       for label, key, p in _VERSUS if row_a[key][p] > row_b[key][p]]
    return "; ".join(losses) if losses else "none"


def runs_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Repeated runs of several systems (each folder a system's run folders, ``.../bench-*``), lowest in bold."""
    runs = [sorted((results_dir / folder).parent.glob(Path(folder).name)) for folder in folders]
    names = [system_of(results_dir, folder) for folder in folders]
    header = ["run", f"TTFT p50 / p99 ms: {' · '.join(names)}", "inter-token p90 ms", "TPOT p50 ms",
              "whole reply p50 s", "in SLO", "raw"]
    rows = []
    for index, run_folders in enumerate(zip(*runs, strict=True), start=1):
        summaries = [bench_rows(folder)[0] for folder in run_folders]
        rows.append([str(index),
                     " · ".join(f"{fixed(s['ttft_ms']['p50'])} / {fixed(s['ttft_ms']['p99'])}" for s in summaries),
                     _lowest([s["itl_ms"]["p90"] for s in summaries], 1),
                     _lowest([s["tpot_ms"]["p50"] for s in summaries], 2),
                     _lowest([s["e2e_ms"]["p50"] / 1000 for s in summaries], 2),
                     " · ".join(percent(s["slo_attainment"]) for s in summaries),
                     ", ".join(raw_link(folder.relative_to(results_dir).as_posix()) for folder in run_folders)])
    return table(header, rows) + "\n\n" + note_for(results_dir, folders)


def _lowest(values: list[float], digits: int) -> str:
    cells = [fixed(value, digits) for value in values]
    best = min(range(len(values)), key=values.__getitem__)
    cells[best] = f"**{cells[best]}**"
    return " · ".join(cells)


def ray_kv_bounds(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: a Ray-served decode engine's KV rate, exact bytes (prompt tokens pulled) over its buckets' time bounds.

    Folders: the reference's (kv-rate.json, ray-metrics-vllm.txt), then one whose config.log gives bytes per token.
    """
    reference, sizing = (results_dir / folder for folder in folders)
    bounds = read_json(reference / "kv-rate.json")
    pulled = metric_sum(read_text(reference / "ray-metrics-vllm.txt"),
                      'ray_vllm_prompt_tokens_by_source_total{', 'source="external_kv_transfer"')
    per_token = float(read_text(sizing / "config.log").split("KV cache ")[1].split(" bytes per token")[0]
                      .replace(",", ""))
    low_s, high_s = bounds["transfer_s_bounds"]
    size_gb = pulled * per_token / 1e9
    return (f"{span([size_gb / high_s, size_gb / low_s])} GB/s ({bounds['transfers']} transfers; "
            f"{fixed(size_gb)} GB by its {pulled:,.0f} prompt tokens pulled at {per_token:,.0f} bytes a token, "
            f"in {fixed(low_s)}-{fixed(high_s)} s by its buckets)")


def kv_sweep_windows(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: a pdserve run's KV rate over its bench alone, from the decode engine's logged windows.

    The folder holds up.log, engine-logs.tgz (decode-0.log) and bench/results.json. Counted: the windows after the
    one that holds the gateway's warm-ups, through the first window logged after the bench's last request.
    """
    folder = results_dir / folders[0]
    requests = gateway_request_times(read_text(folder / "up.log"))
    warm_up_end = max(at for at, rid in requests if rid.startswith("warm-up"))
    bench_total = sum(row["requests"] for row in bench_rows(folder / "bench"))
    bench_end = [at for at, rid in requests if not rid.startswith("warm-up")][bench_total - 1]
    windows = kv_windows(archived_text(folder / "engine-logs.tgz", "./decode-0.log"))
    stamped = [(datetime.strptime(f"{warm_up_end.year}-{w.logged_at}", "%Y-%m-%d %H:%M:%S"), w) for w in windows]
    first = next(index for index, (at, _) in enumerate(stamped) if at >= warm_up_end) + 1
    last = next(index for index, (at, _) in enumerate(stamped) if at >= bench_end)
    counted = [window for _, window in stamped[first:last + 1]]
    size_gb = sum(window.size_bytes for window in counted) / 1e9
    seconds = sum(window.transfer_s for window in counted)
    return (f"{fixed(size_gb / seconds)} GB/s ({sum(w.transfers for w in counted)} of its {bench_total} requests' "
            f"transfers, {fixed(size_gb)} GB in {fixed(seconds, 2)} s)")


RENDERERS: dict[str, Renderer] = {
    "sweep_table": sweep_table,
    "versus_table": versus_table,
    "versus_not_won": versus_not_won,
    "runs_table": runs_table,
    "ray_kv_bounds": ray_kv_bounds,
    "kv_sweep_windows": kv_sweep_windows,
}
