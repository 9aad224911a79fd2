"""Renderers of where PD TTFT goes (benchmarks.md section 8): direct against PD runs, and the split of each."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu.ttft_split import Stats, quantile, split
from bench.report.raw import bench_rows, read_text
from bench.report.tables import Renderer, fixed, raw_link, span, table

_PARTS = {
    "direct": "direct: decode engine TTFT (arrival -> first token)",
    "prefill": "pd: prefill engine TTFT (its arrival -> its one token)",
    "leg": "pd: gateway prefill leg",
    "ttft": "pd: gateway TTFT",
    "handoff": "pd: gateway handoff (prefill done -> first decoded token)",
    "nixl": "pd: decode engine NIXL transfer time",
    "prefill_step": "pd: prefill engine prefill time",
    "direct_step": "direct: decode engine prefill time (scheduled -> first token)",
    "direct_queue": "direct: decode engine queue time",
    "decode": "pd: decode engine TTFT (arrival -> first token)",
    "decode_queue": "pd: decode engine queue time (incl. waiting for KV)",
    "decode_step": "pd: decode engine prefill time (scheduled -> first token)",
    "post": "pd: decode engine NIXL post time",
}
# figures of one run's means (ms) the prose quotes, by the name a block gives after ``@``
_FIGURES: dict[str, Callable[[dict[str, float]], float]] = {
    "hop": lambda m: m["leg"] - m["prefill"],  # the gateway's prefill leg beyond the prefill engine's own TTFT
    "gap": lambda m: m["ttft"] - m["direct"],  # PD TTFT at the gateway beyond direct's
    "prefill": lambda m: m["prefill"],
    "direct": lambda m: m["direct"],
    "prefill_step": lambda m: m["prefill_step"],  # the prefill engine's prefill time (scheduled -> token)
    "direct_step": lambda m: m["direct_step"],
    "prefill_step_slower": lambda m: m["prefill_step"] - m["direct_step"],
    "nixl": lambda m: m["nixl"],  # the decode engine's NIXL time (post -> completion seen)
    "decode_outside": lambda m: m["decode"] - m["decode_queue"] - m["decode_step"],  # outside the decode engine core
    "hops": lambda m: m["leg"] - m["prefill"] + m["handoff"] - m["decode"],  # the gateway's two HTTP hops
}
_RUN_FIGURES: dict[str, Callable[[float, float], float]] = {"direct": lambda direct, pd: direct, "pd": lambda direct, pd: pd,
                "pd-direct": lambda direct, pd: pd - direct}


def direct_pd_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """One row per run folder (its bench/results.json holds targets direct and pd at one rate)."""
    header = ["run", "requests", "direct TTFT ms p50 / p99", "PD TTFT ms p50 / p99", "PD / direct p50, p99",
              "TPOT p50 direct, PD", "ITL p99 direct, PD", "raw"]
    rows = []
    for folder in folders:
        direct, pd = _direct_pd(results_dir, folder)
        rows.append([Path(folder).name, f"{direct['requests']}, {pd['requests']}",
                     _p50_p99(direct), _p50_p99(pd),
                     "**" + ", ".join(f"{pd['ttft_ms'][p] / direct['ttft_ms'][p]:.2f}" for p in ("p50", "p99")) + "**",
                     f"{fixed(direct['tpot_ms']['p50'])}, {fixed(pd['tpot_ms']['p50'])}",
                     f"{fixed(direct['itl_ms']['p99'])}, {fixed(pd['itl_ms']['p99'])}", raw_link(folder)])
    return table(header, rows)


def _direct_pd(results_dir: Path, folder: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's rows of targets direct and pd (its bench/results.json)."""
    by_target = {row["target"]: row for row in bench_rows(results_dir / folder / "bench")}
    return by_target["direct"], by_target["pd"]


def pd_over_direct(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: PD's TTFT over direct's at p50 and at p99, as spans over the runs."""
    pairs = [_direct_pd(results_dir, folder) for folder in folders]
    p50, p99 = ([pd["ttft_ms"][p] / direct["ttft_ms"][p] for direct, pd in pairs] for p in ("p50", "p99"))
    return f"{span(p50, 2)}x at p50 and {span(p99, 2)}x at p99 ({len(pairs)} runs)"


def log_pd_over_direct(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: PD's TTFT over direct's at p50 and p99 from each folder's bench.log (the table `bench run` printed)."""
    ratios: dict[str, list[float]] = {"p50": [], "p99": []}
    for folder in folders:
        rows = {cells[1]: cells for line in read_text(results_dir / folder / "bench.log").splitlines()
                if len(cells := [cell.strip() for cell in line.split("|")]) > 5}
        direct, pd = ([float(q) for q in rows[target][5].split(" / ")] for target in ("direct", "pd"))
        ratios["p50"].append(pd[0] / direct[0])
        ratios["p99"].append(pd[2] / direct[2])
    return f"{span(ratios['p50'], 2)}x at p50 and {span(ratios['p99'], 2)}x at p99 ({len(folders)} run{'s' * (len(folders) > 1)})"


def _p50_p99(row: dict[str, dict[str, float]]) -> str:
    return f"{fixed(row['ttft_ms']['p50'])} / {fixed(row['ttft_ms']['p99'])}"


def split_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Means over each run's requests (ms), from the gateway's and engines' counters around the run."""
    means = [means_ms(results_dir / folder) for folder in folders]
    labels: list[tuple[str, Callable[[dict[str, float]], str]]] = [
        ("direct: the decode engine's own TTFT (vLLM's `time_to_first_token`)", lambda m: fixed(m["direct"])),
        ("PD: the prefill engine's own TTFT", lambda m: fixed(m["prefill"])),
        ("PD: the gateway's prefill leg beyond that (HTTP of the prompt both ways, the engine's API server)",
         lambda m: fixed(m["leg"] - m["prefill"])),
        ("PD: the gateway from the prefill leg's reply to the client's first token", lambda m: fixed(m["ttft"] - m["leg"])),
        ("**PD TTFT at the gateway**", lambda m: f"**{fixed(m['ttft'])}**"),
        ("after the first token: the handoff to the decode engine's first token (p50)",
         lambda m: f"{fixed(m['handoff'])} ({fixed(m['handoff_p50'])})"),
        ("of which the NIXL pull (p50)", lambda m: f"{fixed(m['nixl'])} ({fixed(m['nixl_p50'])})"),
    ]
    rows = [[label, *(cell(m) for m in means)] for label, cell in labels]
    return table(["part", *(raw_link(folder) for folder in folders)], rows)


def split_ms(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline, ``FOLDER... @FIGURE``: one of ``_FIGURES`` from each run's means, as a span over the runs."""
    *folders, name = args
    figure = _FIGURES[name.removeprefix("@")]
    return span([figure(means_ms(results_dir / folder)) for folder in folders], 1, " ms")


def gateway_hop_ms(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the gateway's prefill leg beyond the prefill engine's own TTFT, means over each run, as a span."""
    return split_ms(results_dir, (*folders, "@hop"))


def run_span(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline, ``FOLDER... @WHICH:METRIC:Q`` (WHICH: direct, pd or pd-direct): a results.json figure over the runs."""
    *folders, spec = args
    which, metric, quantile = spec.removeprefix("@").split(":")
    figure = _RUN_FIGURES[which]
    values = [figure(direct[metric][quantile], pd[metric][quantile])
              for direct, pd in (_direct_pd(results_dir, folder) for folder in folders)]
    return span(values, 1, " ms")


def handoff_ms(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the handoff to the decode engine's first token and its NIXL pull, means over each run, as spans."""
    means = [means_ms(results_dir / folder) for folder in folders]
    return (f"{span([m['handoff'] for m in means], 0, ' ms')} at the mean, of it "
            f"{span([m['nixl'] for m in means], 0, ' ms')} NIXL")


def means_ms(folder: Path) -> dict[str, float]:
    """Each part's mean in ms, and the handoff's and NIXL pull's p50."""
    _, rows = split(folder)
    stats = dict(rows)
    means = {key: _mean_ms(stats[label]) for key, label in _PARTS.items()}
    means["handoff_p50"] = _p50_ms(stats[_PARTS["handoff"]])
    means["nixl_p50"] = _p50_ms(stats[_PARTS["nixl"]])
    return means


def _mean_ms(stats: Stats) -> float:
    total, count, _ = stats
    return total / count * 1e3


def _p50_ms(stats: Stats) -> float:
    _, count, buckets = stats
    return (quantile(buckets, count, 0.5) or 0.0) * 1e3


RENDERERS: dict[str, Renderer] = {
    "direct_pd_table": direct_pd_table,
    "split_table": split_table,
    "gateway_hop_ms": gateway_hop_ms,
    "split_ms": split_ms,
    "run_span": run_span,
    "pd_over_direct": pd_over_direct,
    "log_pd_over_direct": log_pd_over_direct,
    "handoff_ms": handoff_ms,
}
