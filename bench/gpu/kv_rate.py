"""KV handoff bandwidth from vLLM's own NIXL statistics, read the same way for any system: the bytes moved over
the time the transfers took. Two sources of the same numbers (vLLM 0.26, distributed/kv_transfer/kv_connector/
v1/nixl/stats.py): its "KV Transfer metrics" log lines (one per logging window, written only where something
calls the engine's do_log_stats, as vLLM's API server does; Ray Serve LLM's replicas do not), and its
Prometheus histograms vllm:nixl_bytes_transferred and vllm:nixl_xfer_time_seconds (an engine's /metrics; Ray
Serve LLM exports them through Ray's metrics port as ray_vllm_nixl_..., vllm/v1/metrics/ray_wrappers.py).
Prints one JSON object: transfers, GB moved, seconds of transfer, GB/s.

    python3 bench/gpu/kv_rate.py FILE [FILE ...]     (engine logs, or /metrics scrapes taken after the load)
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

_WINDOW = re.compile(r"KV Transfer metrics: Num successful transfers=(\d+), .*?Avg MB per transfer=([\d.]+), "
                     r"Throughput \(MB/s\)=([\d.]+)")
_HISTOGRAM = re.compile(r"^(?:ray_)?vllm[:_]nixl_(bytes_transferred|xfer_time_seconds)_(sum|count)(?:\{[^}]*\})? "
                        r"([\d.eE+-]+)$", re.MULTILINE)


def from_log(text: str) -> tuple[int, float, float]:
    """Transfers, bytes and seconds of the log's windows (vLLM's MB are MiB)."""
    transfers, megabytes, seconds = 0, 0.0, 0.0
    for count, avg_mb, mb_per_s in _WINDOW.findall(text):
        if int(count) == 0 or float(mb_per_s) == 0:
            continue
        window_mb = int(count) * float(avg_mb)
        transfers += int(count)
        megabytes += window_mb
        seconds += window_mb / float(mb_per_s)
    return transfers, megabytes * 2**20, seconds


def from_metrics(text: str) -> tuple[int, float, float]:
    """Transfers, bytes and seconds summed over every engine's series of the scrape."""
    totals: defaultdict[tuple[str, str], float] = defaultdict(float)
    for metric, part, value in _HISTOGRAM.findall(text):
        totals[metric, part] += float(value)
    return (int(totals["bytes_transferred", "count"]), totals["bytes_transferred", "sum"],
            totals["xfer_time_seconds", "sum"])


def main() -> None:
    transfers, moved_bytes, seconds = 0, 0.0, 0.0
    for path in sys.argv[1:]:
        text = Path(path).read_text(errors="replace")
        count, size, duration = from_metrics(text) if _HISTOGRAM.search(text) else from_log(text)
        transfers, moved_bytes, seconds = transfers + count, moved_bytes + size, seconds + duration
    print(json.dumps({"transfers": transfers, "gb": round(moved_bytes / 1e9, 2), "transfer_s": round(seconds, 3),
                      "gb_per_s": round(moved_bytes / 1e9 / seconds, 1) if seconds else None}))


if __name__ == "__main__":
    main()
