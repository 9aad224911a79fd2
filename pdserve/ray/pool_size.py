"""How many engines a pool needs, from its engines' own load. Pure: Ray Serve's glue is autoscaling.py.

A pool's load is the sum over its engines of their requests (running + waiting) and of their KV
cache use; it needs as many engines as hold that sum at the pool's targets per engine. It grows
at once to that many, and shrinks one engine at a time, only on a reading of every engine.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pdserve.cluster_config import PoolScalingSpec
from pdserve.routing.load import EngineLoad

# The names an engine replica reports its load under (Serve's custom autoscaling metrics).
REQUESTS_STAT, KV_USAGE_STAT = "requests", "kv_usage"
Replica = TypeVar("Replica", bound=Hashable)  # Serve's ReplicaID; any key in tests


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One engine's load as Serve hands it to the policy: averaged over Serve's look-back window."""

    requests: float  # running + waiting
    kv_usage: float  # 0..1


def report_stats(load: EngineLoad) -> dict[str, float]:
    """What an engine replica reports to Serve for one read of its engine."""
    return {REQUESTS_STAT: load.running + load.waiting, KV_USAGE_STAT: load.kv_usage}


def engine_stats(aggregated: Mapping[str, Mapping[Replica, float]], replicas: Iterable[Replica]) -> list[EngineStats]:
    """The stats of those ``replicas`` that reported both values; ``aggregated``: stat -> replica -> value."""
    requests, kv_usage = aggregated.get(REQUESTS_STAT, {}), aggregated.get(KV_USAGE_STAT, {})
    return [EngineStats(requests=requests[replica], kv_usage=kv_usage[replica])
            for replica in replicas if replica in requests and replica in kv_usage]


def engines_needed(stats: Sequence[EngineStats], *, spec: PoolScalingSpec) -> int:
    """Fewest engines that would carry this load at ``spec``'s targets per engine."""
    requests = sum(engine.requests for engine in stats)
    kv_usage = sum(engine.kv_usage for engine in stats)
    return max(math.ceil(requests / spec.target_requests), math.ceil(kv_usage / spec.max_kv_usage))


def next_pool_size(stats: Sequence[EngineStats], *, target: int, running: int, spec: PoolScalingSpec) -> int:
    """The pool's next size, within ``spec``'s bounds.

    ``target``: the size Serve is working towards now; ``running``: its replicas running now;
    ``stats``: those of them that have reported. With no report the size stays. It grows straight
    to what the reported load needs (a lower bound while some have not reported), and shrinks by
    one only when every running engine has reported: an engine not heard from may be busy.
    """
    wanted = target
    if stats:
        needed = engines_needed(stats, spec=spec)
        if needed > target:
            wanted = needed
        elif needed < target and len(stats) == running:
            wanted = target - 1
    return min(max(wanted, spec.min_engines), spec.max_engines)
