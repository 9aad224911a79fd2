"""What an engine's own /metrics says of its load: scheduler queues, KV cache use, prefix cache.

Routing weighs these against the prompt's expected cache overlap (routing/cost.py); ``pdserve
status`` shows them. Pure: the gateway's KV monitor fetches the page and stores the reading.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

_RUNNING, _WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
_KV_USAGE = "vllm:kv_cache_usage_perc"  # a fraction, 1.0 = full, despite the name
_PREFIX_QUERIES, _PREFIX_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"  # in tokens
_CACHE_CONFIG = "vllm:cache_config_info"  # a gauge of 1 whose labels are the engine's CacheConfig
# A decode engine's requests by KV load stage (vLLM 0.32; older ones do not say): those whose pull is pending.
_KV_FETCH, _KV_FETCH_PENDING = "vllm:num_requests_kv_fetch_by_stage", ('stage="waiting_to_start"', 'stage="in_progress"')
_NAMES = frozenset((_RUNNING, _WAITING, _KV_USAGE, _PREFIX_QUERIES, _PREFIX_HITS, _CACHE_CONFIG, _KV_FETCH))
# The sample lines parse_engine_load reads; "{" keeps out the *_by_reason and *_created kin.
SAMPLE_PREFIXES = tuple(sorted(name + "{" for name in _NAMES))
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')  # name="value", escapes kept as written


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One read of an engine, summed over its engine cores (data-parallel ranks); KV use averaged."""

    running: float = 0.0  # requests in its batches
    waiting: float = 0.0  # requests queued in its scheduler (on a decode engine: also those awaiting KV)
    kv_usage: float = 0.0  # fraction of its KV cache blocks in use, 0..1
    kv_capacity_tokens: float = 0.0  # tokens its KV cache holds; 0 when the engine does not say
    block_size: float = 0.0  # tokens per KV block; 0 when the engine does not say (a float: workers share loads as doubles)
    prefix_queried_tokens: float = 0.0  # since it started: prompt tokens looked up in its prefix cache
    prefix_hit_tokens: float = 0.0  # since it started: of those, tokens found cached
    kv_pulls_pending: float = 0.0  # a decode engine's requests whose KV pull has not finished (0: none, or it does not say)
    read_s: float = -math.inf  # time.monotonic() of the read; -inf: never read

    @property
    def prefix_hit_rate(self) -> float | None:
        """Cached share of the prompt tokens it has seen since it started; None before any."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens > 0 else None

    @property
    def is_idle(self) -> bool:
        """No request in its scheduler and no KV block in use; a prefill engine keeps a finished
        prompt's blocks until the decode engine has pulled them."""
        return self.running == 0 and self.waiting == 0 and self.kv_usage == 0

    def age_s(self, now_s: float) -> float:
        """Seconds since the read (inf when never read)."""
        return now_s - self.read_s


def parse_engine_load(metrics_text: str, *, read_s: float) -> EngineLoad:
    """The load in ``metrics_text`` (vLLM's Prometheus text, whole or cut to SAMPLE_PREFIXES).

    Missing samples read as 0, so an engine that exports less (an older vLLM) still routes by
    what it does export. ``read_s``: time.monotonic() when the page was fetched.
    """
    sums = dict.fromkeys((_RUNNING, _WAITING, _PREFIX_QUERIES, _PREFIX_HITS), 0.0)
    usages: list[float] = []
    capacity_tokens = block_size = pulls_pending = 0.0
    for name, labels, value in _samples(metrics_text):
        if name in sums:
            sums[name] += value
        elif name == _KV_FETCH:
            pulls_pending += value if any(stage in labels for stage in _KV_FETCH_PENDING) else 0.0
        elif name == _KV_USAGE:
            usages.append(value)
        elif name == _CACHE_CONFIG:
            cache_config = dict(_LABEL.findall(labels))
            capacity_tokens += cache_capacity_tokens(cache_config)
            block_size = max(block_size, _number(cache_config.get("block_size")))
    return EngineLoad(
        running=sums[_RUNNING], waiting=sums[_WAITING], kv_usage=sum(usages) / len(usages) if usages else 0.0,
        kv_capacity_tokens=capacity_tokens, block_size=block_size, prefix_queried_tokens=sums[_PREFIX_QUERIES],
        prefix_hit_tokens=sums[_PREFIX_HITS], kv_pulls_pending=pulls_pending, read_s=read_s,
    )


def _samples(metrics_text: str) -> Iterator[tuple[str, str, float]]:
    """(name, labels text, value) of each labelled sample line of the names read here.

    A plain split, not prometheus_client's parser: that takes ~1.5 ms for these few lines (the
    cache_config_info line alone carries ~40 labels), on the event loop, every second, per engine.
    """
    for line in metrics_text.splitlines():
        name, _, rest = line.partition("{")
        if name not in _NAMES:
            continue
        labels, _, value_text = rest.rpartition("}")
        try:
            yield name, labels, float(value_text.split()[0])
        except (ValueError, IndexError):
            continue


def cache_capacity_tokens(labels: dict[str, str]) -> float:
    """Tokens one engine core's KV cache holds, from its cache_config_info labels: vLLM's own
    ``kv_cache_size_tokens`` (right for hybrid models too), else blocks x block size, else 0."""
    size = _number(labels.get("kv_cache_size_tokens"))
    if size > 0:
        return size
    return _number(labels.get("num_gpu_blocks")) * _number(labels.get("block_size"))


def _number(label: str | None) -> float:
    """A label's value as a number; vLLM writes an unset field as "None"."""
    try:
        value = float(label) if label is not None else 0.0
    except ValueError:
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0
