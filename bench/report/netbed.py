"""Renderers of PD across the bed of hosts (benchmarks.md section 10): the link between the engines, shaped."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.report.raw import read_json
from bench.report.tables import Renderer, fixed, raw_link, span, table


def _links(folder: Path) -> list[dict[str, Any]]:
    """A run's links: raw.json is the links' list itself (run 1's format) or holds them under ``links``."""
    raw = read_json(folder / "raw.json")
    links: list[dict[str, Any]] = raw if isinstance(raw, list) else raw["links"]
    return links


def _medians_ms(link: dict[str, Any]) -> dict[str, float]:
    """Medians of one link's requests, as bench/netbed_links.py's own table takes them."""
    pd = [run for run in link["requests"] if run["mode"] == "pd"]
    local = [run for run in link["requests"] if run["mode"] == "local"]
    return {"handoff": statistics.median(run["handoff_s"] for run in pd if run["handoff_s"] is not None) * 1e3,
            "pd": statistics.median(run["client_ttft_s"] for run in pd) * 1e3,
            "local": statistics.median(run["client_ttft_s"] for run in local) * 1e3}


def _link_name(rate_mbit: int) -> str:
    return f"{rate_mbit} Mbit/s" if rate_mbit else "veth, unshaped"


def link_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """One row per link; each cell the runs' figures in the folders' order (medians over each run's requests)."""
    runs = [_links(results_dir / folder) for folder in folders]
    rows = []
    for links in zip(*runs, strict=True):
        medians = [_medians_ms(link) for link in links]
        verdicts = [link["verify"] for link in links]
        passed = sum(bool(verdict["ok"]) for verdict in verdicts)
        rows.append([_link_name(links[0]["rate_mbit"]),
                     " / ".join(f"{verdict['verdict']['measured_gbps']:.3f}" for verdict in verdicts),
                     *(" / ".join(fixed(m[key], 0) for m in medians) for key in ("handoff", "pd", "local")),
                     f"OK {passed}, FAIL {len(verdicts) - passed}"])
    header = ["link", "KV GB/s (engine)", "handoff ms (median)", "PD TTFT ms (median)", "local TTFT ms (median)",
              "verify"]
    return table(header, rows) + "\n\nRuns, in each cell's order: " + ", ".join(raw_link(f) for f in folders)


def pd_over_local_ms(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: PD's median TTFT above local's on the slowest shaped link, over the runs."""
    gaps = []
    for folder in folders:
        link = min((link for link in _links(results_dir / folder) if link["rate_mbit"]), key=lambda l: l["rate_mbit"])
        medians = _medians_ms(link)
        gaps.append(medians["pd"] - medians["local"])
    return span(gaps, 0, " ms")


def kv_gbps(results_dir: Path, folders: tuple[str, ...], *, shaped: bool) -> str:
    """Inline: verify's KV rate on the slowest shaped link of each run (``shaped``), or on every other link."""
    rates = []
    for folder in folders:
        links = _links(results_dir / folder)
        slowest = min(link["rate_mbit"] for link in links if link["rate_mbit"])
        rates += [link["verify"]["verdict"]["measured_gbps"] for link in links
                  if (link["rate_mbit"] == slowest) == shaped]
    return span(rates, 3 if shaped else 2, " GB/s")


RENDERERS: dict[str, Renderer] = {
    "netbed_link_table": link_table,
    "netbed_pd_over_local_ms": pd_over_local_ms,
    "netbed_shaped_kv_gbps": lambda results_dir, folders: kv_gbps(results_dir, folders, shaped=True),
    "netbed_unshaped_kv_gbps": lambda results_dir, folders: kv_gbps(results_dir, folders, shaped=False),
}
