"""KV handoff bandwidth from vLLM's own NIXL statistics, read the same way for any system: the bytes moved over
the time the transfers took. Two sources of the same numbers (vLLM 0.26, distributed/kv_transfer/kv_connector/
v1/nixl/stats.py): its "KV Transfer metrics" log lines (one per logging window, written only where something
calls the engine's do_log_stats, as vLLM's API server does; Ray Serve LLM's replicas do not), and its
Prometheus histograms vllm:nixl_bytes_transferred and vllm:nixl_xfer_time_seconds (an engine's /metrics; Ray
Serve LLM exports them through Ray's metrics port as ray_vllm_nixl_..., vllm/v1/metrics/ray_wrappers.py).
Prints one JSON object: transfers, GB moved, seconds of transfer, GB/s.

Ray's export is not exact: its dashboard agent passes on a histogram's bucket counts only and rebuilds the sum as
each observation at its bucket's midpoint (ray/_private/telemetry/open_telemetry_metric_recorder.py,
record_histogram_aggregated_batch: "The histogram sum value will be an approximation"). So a Ray scrape gives no
GB, seconds or GB/s (null) but what its buckets bound: ``gb_bounds``, ``transfer_s_bounds``, ``gb_per_s_bounds``
(each observation between its bucket's lower and upper edge).

    python3 bench/gpu/kv_rate.py FILE [FILE ...]     (engine logs, or /metrics scrapes taken after the load)
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

_WINDOW = re.compile(r"KV Transfer metrics: Num successful transfers=(\d+), .*?Avg MB per transfer=([\d.]+), "
                     r"Throughput \(MB/s\)=([\d.]+)")
_HISTOGRAM = re.compile(r"^vllm:nixl_(bytes_transferred|xfer_time_seconds)_(sum|count)(?:\{[^}]*\})? "
                        r"([\d.eE+-]+)$", re.MULTILINE)
_RAY_BUCKET = re.compile(r"^ray_vllm_nixl_(bytes_transferred|xfer_time_seconds)_bucket\{([^}]*)\} ([\d.eE+-]+)$",
                         re.MULTILINE)
_LE = re.compile(r'(?:^|,)le="([^"]*)"')
Bounds = tuple[float, float]


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


def from_ray_buckets(text: str) -> tuple[int, Bounds, Bounds]:
    """Transfers, and the bounds of bytes and seconds, from the cumulative buckets of every replica's series."""
    series: defaultdict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for metric, labels, value in _RAY_BUCKET.findall(text):
        bucket = _LE.search(labels)
        if bucket is not None:
            series[metric, _LE.sub("", labels)].append((float(bucket.group(1)), float(value)))
    transfers, bounds = 0, {"bytes_transferred": [0.0, 0.0], "xfer_time_seconds": [0.0, 0.0]}
    for (metric, _), buckets in series.items():
        lower, below = 0.0, 0.0
        for edge, cumulative in sorted(buckets):
            if cumulative > below:  # an observation above the last finite edge leaves the upper bound infinite
                bounds[metric][0] += (cumulative - below) * lower
                bounds[metric][1] += (cumulative - below) * edge
            lower, below = edge, cumulative
        if metric == "bytes_transferred":
            transfers += int(below)
    size, seconds = bounds["bytes_transferred"], bounds["xfer_time_seconds"]
    return transfers, (size[0], size[1]), (seconds[0], seconds[1])


def _finite(value: float, digits: int) -> float | None:
    """``value`` rounded, or None for an unbounded one (JSON has no infinity)."""
    return round(value, digits) if math.isfinite(value) else None


def main() -> None:
    texts = [Path(path).read_text(errors="replace") for path in sys.argv[1:]]
    if any(_RAY_BUCKET.search(text) for text in texts):
        rays = [from_ray_buckets(text) for text in texts]
        gb = (sum(ray[1][0] for ray in rays) / 1e9, sum(ray[1][1] for ray in rays) / 1e9)
        span = (sum(ray[2][0] for ray in rays), sum(ray[2][1] for ray in rays))
        print(json.dumps({"transfers": sum(ray[0] for ray in rays), "gb": None, "transfer_s": None, "gb_per_s": None,
                          "gb_bounds": [_finite(gb[0], 2), _finite(gb[1], 2)],
                          "transfer_s_bounds": [_finite(span[0], 3), _finite(span[1], 3)],
                          "gb_per_s_bounds": [_finite(gb[0] / span[1], 1) if span[1] and math.isfinite(span[1]) else None,
                                              _finite(gb[1] / span[0], 1) if span[0] else None]}))
        return
    transfers, moved_bytes, seconds = 0, 0.0, 0.0
    for text in texts:
        count, size_bytes, duration = from_metrics(text) if _HISTOGRAM.search(text) else from_log(text)
        transfers, moved_bytes, seconds = transfers + count, moved_bytes + size_bytes, seconds + duration
    print(json.dumps({"transfers": transfers, "gb": round(moved_bytes / 1e9, 2), "transfer_s": round(seconds, 3),
                      "gb_per_s": round(moved_bytes / 1e9 / seconds, 1) if seconds else None}))


if __name__ == "__main__":
    main()
