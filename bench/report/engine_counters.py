"""Renderers of a pdserve run's counters at its end: the decode engine's queue and the gateway's KV handoffs.

The folder holds decode-metrics.txt(.gz) (the decode engine's /metrics) and gateway-metrics.txt (the gateway's).
Per-request figures divide by the gateway's handed-off requests, whichever total they come from.
"""

from __future__ import annotations

from pathlib import Path

from bench.report.raw import metric_sum, read_json, read_text
from bench.report.tables import Renderer, fixed


def _handoffs(folder: Path) -> tuple[float, int]:
    """``pdserve_kv_handoff_seconds``: its sum (s) and its count, the requests the gateway handed off."""
    text = read_text(folder / "gateway-metrics.txt")
    return (metric_sum(text, "pdserve_kv_handoff_seconds_sum"),
            round(metric_sum(text, "pdserve_kv_handoff_seconds_count")))


def decode_queue(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the decode engine's summed queue time, its requests, and the time per handed-off request."""
    folder = results_dir / folders[0]
    text = read_text(folder / "decode-metrics.txt")
    queued_s = metric_sum(text, "vllm:request_queue_time_seconds_sum")
    requests = round(metric_sum(text, "vllm:request_queue_time_seconds_count"))
    _, handed_off = _handoffs(folder)
    return (f"{fixed(queued_s)} s over its {requests} requests, {_duration(queued_s / handed_off)} each of the "
            f"{handed_off} handed off (the other {requests - handed_off}: the gateway's start-up warm-ups)")


def handoff_mean(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the gateway's mean KV handoff (prefill done -> the decode engine's first token) and its count."""
    total_s, count = _handoffs(results_dir / folders[0])
    return f"{_duration(total_s / count)} over {count} handoffs"


def kv_rate(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the decode engine's KV rate over the deployment's life (kv-rate.json), and whose transfers it counts."""
    folder = results_dir / folders[0]
    rate = read_json(folder / "kv-rate.json")
    _, handed_off = _handoffs(folder)
    return (f"{fixed(rate['gb_per_s'])} GB/s over {rate['transfers']} transfers ({handed_off} the gateway's handoffs "
            f"of the runs, {rate['transfers'] - handed_off} its start-up warm-ups; "
            f"[`kv-rate.json`](results/{folders[0]}/kv-rate.json))")


def _duration(seconds: float) -> str:
    return f"{fixed(seconds * 1e3, 0)} ms" if seconds < 1 else f"{fixed(seconds, 2)} s"


def preemptions(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the decode engine's ``vllm:num_preemptions_total`` at the run's end."""
    text = read_text(results_dir / folders[0] / "decode-metrics.txt")
    return f"{metric_sum(text, 'vllm:num_preemptions_total'):.0f}"


RENDERERS: dict[str, Renderer] = {
    "decode_queue": decode_queue,
    "handoff_mean": handoff_mean,
    "decode_preemptions": preemptions,
    "kv_rate": kv_rate,
}
