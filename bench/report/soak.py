"""Renderers of `bench/soak.py` output (reliability.md, "Soak"): outcomes, faults, KV left behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report.raw import metric_sum, read_json
from bench.report.tables import Renderer, fixed, table


def _soak(results_dir: Path, folder: str) -> dict[str, Any]:
    raw: dict[str, Any] = read_json(results_dir / folder / "results.json")
    return raw


def outcomes_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """The requests by outcome, and how many were lost."""
    soak = _soak(results_dir, folders[0])
    kinds, retry = soak["kinds"], soak["retry_after_s"]
    rows = [["success", str(kinds["ok"])],
            ["explicit error: 400 for the malformed bodies", str(kinds["error"])],
            ["client left mid-stream, on purpose", str(kinds["disconnected"])],
            [f"429 past the gateway's bounds, `Retry-After` (s: count) {', '.join(f'{s}: {n}' for s, n in retry.items())}",
             str(kinds["rejected"])],
            ["**lost (no answer in 120 s, or a stream cut without `[DONE]`)**",
             f"**{len(soak['lost'])} of {soak['requests']:,}**"]]
    return table(["outcome", "requests"], rows) + f"\n\nRaw: [`{folders[0]}/results.json`](results/{folders[0]}/results.json)"


def faults(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: requests that succeeded during engine faults, the gateway's fallbacks and each fault's recovery."""
    soak = _soak(results_dir, folders[0])
    metrics = "\n".join(soak["gateway_metrics"])
    recovery = ", ".join(f"{fault['fault']} {fixed(fault['recovered_s'])} s" for fault in soak["faults"])
    return (f"{soak['succeeded_despite_engine_fault']} of {soak['engine_fault_window_requests']} answered requests "
            f"succeeded while an engine fault was active; the gateway prefilled "
            f"{metric_sum(metrics, 'pdserve_local_fallbacks_total'):.0f} requests on a decode engine "
            f"({metric_sum(metrics, 'pdserve_local_fallbacks_total', 'prefill_failed'):.0f} after a failed prefill leg, "
            f"{metric_sum(metrics, 'pdserve_local_fallbacks_total', 'no_prefill_engine'):.0f} with no prefill engine) "
            f"and restarted {metric_sum(metrics, 'pdserve_decode_switches_total', 'restarted'):.0f} on another decode "
            f"engine before their first byte; recovery: {recovery}")


def kv_left(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: each engine's KV cache use 3 s after the last request, and when every cache was empty."""
    soak = _soak(results_dir, folders[0])
    held = [f"{usage * 100:.3f}%" for usage in soak["kv_usage_after"].values()]
    return (f"engines' KV cache use 3 s after the last request {', '.join(held)}; every cache empty "
            f"{fixed(soak['kv_idle_after_s'])} s later")


RENDERERS: dict[str, Renderer] = {"soak_outcomes": outcomes_table, "soak_faults": faults, "soak_kv_left": kv_left}
