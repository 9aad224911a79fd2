"""Where a PD request's TTFT goes, from the counters pd_pair.sh samples (run here, on its unpacked folder).

The gateway's histograms split PD TTFT into the prefill leg and the handoff (prefill done -> first decoded
token); the decode engine's own histograms say how long it held the request before the first token (queue,
the KV pull, the step that computes the last prompt token) and how long NIXL took; the prefill engine's,
how long the prefill itself took. Direct runs first, then PD: the decode-engine sample taken between the
two phases splits its histograms. Means are exact (sum / count); p50/p90 are interpolated in the buckets.

usage: python3 bench/gpu/ttft_split.py FOLDER   (FOLDER holds metrics-before.txt, metrics-after.txt,
       metrics-decode-samples.txt or .txt.gz)
"""

from __future__ import annotations

import gzip
import math
import sys
from collections import defaultdict
from pathlib import Path

COARSE_BUCKET_S = 0.05  # a first bucket wider than this gives no useful percentile


def read_snapshots(path: Path) -> list[tuple[float, str, dict[str, float]]]:
    """Every ``# <unix time> <url>`` block of a metrics file (or of its .gz), in order."""
    zipped = path.with_name(path.name + ".gz")
    text = path.read_text() if path.exists() else gzip.decompress(zipped.read_bytes()).decode()
    blocks: list[tuple[float, str, dict[str, float]]] = []
    for line in text.splitlines():
        if line.startswith("# "):
            _, stamp, url = line.split(" ", 2)
            blocks.append((float(stamp), url, {}))
        elif blocks and " " in line:
            key, value = line.rsplit(" ", 1)
            blocks[-1][2][_drop_engine_label(key)] = float(value)
    return blocks


def _drop_engine_label(key: str) -> str:
    """vLLM labels every series with its engine index and model name; one engine per URL here."""
    if "{" not in key:
        return key
    name, labels = key[:-1].split("{", 1)
    kept = [part for part in labels.split(",") if part and not part.startswith(("engine=", "model_name="))]
    return f"{name}{{{','.join(kept)}}}" if kept else name


def histogram(values: dict[str, float], name: str) -> tuple[float, float, list[tuple[float, float]]]:
    """(sum, count, [(upper bound, cumulative count)]) of one histogram, summed over any other labels;
    ``name{label="value"}`` keeps only the series with that label."""
    name, _, wanted = name.partition("{")
    wanted = wanted.rstrip("}")
    buckets: dict[float, float] = defaultdict(float)
    total = count = 0.0
    for key, value in values.items():
        if wanted and wanted not in key:
            continue
        if key.startswith(f"{name}_bucket"):
            bound = key.split('le="', 1)[1].split('"', 1)[0]
            buckets[math.inf if bound == "+Inf" else float(bound)] += value
        elif key.split("{", 1)[0] == f"{name}_sum":
            total += value
        elif key.split("{", 1)[0] == f"{name}_count":
            count += value
    return total, count, sorted(buckets.items())


def since(late: dict[str, float], early: dict[str, float], name: str) -> tuple[float, float, list[tuple[float, float]]]:
    total_late, count_late, buckets_late = histogram(late, name)
    total_early, count_early, buckets_early = histogram(early, name)
    before = dict(buckets_early)
    return (total_late - total_early, count_late - count_early,
            [(bound, n - before.get(bound, 0.0)) for bound, n in buckets_late])


def quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float | None:
    if count <= 0:
        return None
    rank, lower, below = q * count, 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower
            share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
            return lower + (bound - lower) * share
        lower, below = bound, cumulative
    return lower


def line(label: str, stats: tuple[float, float, list[tuple[float, float]]]) -> str:
    total, count, buckets = stats
    if count <= 0:
        return f"{label:<60} (no samples)"
    mean = f"{label:<60} n={count:4.0f}  mean {total / count * 1e3:7.1f} ms"
    if not buckets or buckets[0][0] > COARSE_BUCKET_S:
        return mean  # vLLM's request-phase histograms start at 0.3 s: percentiles would be made up
    p50, p90 = quantile(buckets, count, 0.5), quantile(buckets, count, 0.9)
    return f"{mean}  p50 {(p50 or 0) * 1e3:7.1f}  p90 {(p90 or 0) * 1e3:7.1f}"


Stats = tuple[float, float, list[tuple[float, float]]]  # (sum, count, cumulative buckets)


def split(folder: Path) -> tuple[float, list[tuple[str, Stats]]]:
    """The direct requests counted before the phase boundary, and each part's histogram over the run."""
    before = {url: values for _, url, values in read_snapshots(folder / "metrics-before.txt")}
    after = {url: values for _, url, values in read_snapshots(folder / "metrics-after.txt")}
    gateway, prefill, decode = list(before)
    samples = [values for _, url, values in read_snapshots(folder / "metrics-decode-samples.txt") if url == decode]
    nixl_start = histogram(before[decode], "vllm:nixl_xfer_time_seconds")[1]
    e2e_start = histogram(before[decode], "vllm:e2e_request_latency_seconds")[1]
    # the last sample before the first PD pull: every direct request has finished by then
    boundary = max((s for s in samples if histogram(s, "vllm:nixl_xfer_time_seconds")[1] == nixl_start),
                   key=lambda s: histogram(s, "vllm:e2e_request_latency_seconds")[1], default=before[decode])
    direct_n = histogram(boundary, "vllm:e2e_request_latency_seconds")[1] - e2e_start
    rows = [
        ("direct: decode engine TTFT (arrival -> first token)", since(boundary, before[decode], "vllm:time_to_first_token_seconds")),
        ("direct: decode engine queue time", since(boundary, before[decode], "vllm:request_queue_time_seconds")),
        ("direct: decode engine prefill time (scheduled -> first token)", since(boundary, before[decode], "vllm:request_prefill_time_seconds")),
        ("pd: gateway TTFT", since(after[gateway], before[gateway], 'pdserve_time_to_first_token_seconds{mode="pd"}')),
        ("pd: gateway prefill leg", since(after[gateway], before[gateway], 'pdserve_leg_duration_seconds{role="prefill"}')),
        ("pd: gateway handoff (prefill done -> first decoded token)", since(after[gateway], before[gateway], "pdserve_kv_handoff_seconds")),
        ("pd: prefill engine TTFT (its arrival -> its one token)", since(after[prefill], before[prefill], "vllm:time_to_first_token_seconds")),
        ("pd: prefill engine queue time", since(after[prefill], before[prefill], "vllm:request_queue_time_seconds")),
        ("pd: prefill engine prefill time", since(after[prefill], before[prefill], "vllm:request_prefill_time_seconds")),
        ("pd: decode engine TTFT (arrival -> first token)", since(after[decode], boundary, "vllm:time_to_first_token_seconds")),
        ("pd: decode engine queue time (incl. waiting for KV)", since(after[decode], boundary, "vllm:request_queue_time_seconds")),
        ("pd: decode engine prefill time (scheduled -> first token)", since(after[decode], boundary, "vllm:request_prefill_time_seconds")),
        ("pd: decode engine NIXL transfer time", since(after[decode], boundary, "vllm:nixl_xfer_time_seconds")),
        ("pd: decode engine NIXL post time", since(after[decode], boundary, "vllm:nixl_post_time_seconds")),
    ]
    return direct_n, rows


def main(folder: Path) -> None:
    direct_n, rows = split(folder)
    print(f"direct requests finished at the phase boundary sample: {direct_n:.0f}")
    for label, stats in rows:
        print(line(label, stats))
    before = {url: values for _, url, values in read_snapshots(folder / "metrics-before.txt")}
    after = {url: values for _, url, values in read_snapshots(folder / "metrics-after.txt")}
    decode = list(before)[2]
    moved = {key: after[decode].get(key, 0.0) - before[decode].get(key, 0.0) for key in after[decode]}
    print("pd: decode engine NIXL counters:", ", ".join(f"{key} +{value:.4g}" for key, value in moved.items()
                                                      if key.startswith("vllm:nixl") and "bucket" not in key
                                                      and value))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
