"""What a decode engine's /metrics says beyond its KV counters (pd/transfer_stats.py): how busy
its scheduler was when read, and how many of its KV transfers were slow on their own. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

_WAITING, _RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"
_TRANSFER_BUCKET = "vllm:nixl_xfer_time_seconds_bucket"  # NIXL's own timing of each transfer
# The sample lines parse_engine_state reads (the gauges with their labels, not their *_by_reason kin).
SAMPLE_PREFIXES = (_WAITING + "{", _RUNNING + "{", _TRANSFER_BUCKET)


@dataclass(frozen=True, slots=True)
class EngineState:
    waiting: float = 0.0  # requests queued in its scheduler when read
    running: float = 0.0  # requests in its batches when read
    slow_transfers: float = 0.0  # since it started: KV transfers that alone took longer than the threshold


def parse_engine_state(metrics_text: str, *, slow_transfer_s: float) -> EngineState:
    """Sum each value over all label sets (one per engine core).

    ``slow_transfers`` counts transfers above the smallest histogram bound at or above
    ``slow_transfer_s`` (vLLM's bounds: 5 ms to 5 s), so it never counts one that was faster;
    with no such bound (a threshold above 5 s) it is 0.
    """
    waiting = running = 0.0
    buckets: dict[float, float] = {}  # upper bound, s -> transfers that took at most that long
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == _WAITING:
                waiting += sample.value
            elif sample.name == _RUNNING:
                running += sample.value
            elif sample.name == _TRANSFER_BUCKET:
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    total = buckets.get(math.inf, 0.0)
    bound = min((le for le in buckets if le >= slow_transfer_s), default=math.inf)
    return EngineState(waiting=waiting, running=running, slow_transfers=total - buckets.get(bound, total))
