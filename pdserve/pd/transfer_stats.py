"""Read a decode engine's KV-transfer counters (vLLM's NIXL metrics) from its ``/metrics``.

The engines know how many bytes they pulled and how long it took; the gateway and
``pdserve verify`` only read those counters, they never guess transfer sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# family name (as the parser reports it) -> (sample name, required label, field)
_SAMPLES = {
    "vllm:nixl_bytes_transferred_sum": "bytes",
    "vllm:nixl_xfer_time_seconds_sum": "seconds",
    "vllm:nixl_xfer_time_seconds_count": "transfers",
    "vllm:nixl_num_failed_transfers_total": "failed",
}
_EXTERNAL_TOKENS = "vllm:prompt_tokens_by_source_total"
# The sample lines parse_counters reads: a caller may keep only these before parsing a large page.
SAMPLE_PREFIXES = (*_SAMPLES, _EXTERNAL_TOKENS)


@dataclass(frozen=True, slots=True)
class TransferCounters:
    """Cumulative since the engine started; subtract two readings for one window."""

    bytes: float = 0.0
    seconds: float = 0.0
    transfers: float = 0.0
    failed: float = 0.0
    external_tokens: float = 0.0  # prompt tokens whose KV arrived over the connector

    def since(self, earlier: TransferCounters) -> TransferCounters:
        return self._combine(earlier, sign=-1.0)

    def plus(self, other: TransferCounters) -> TransferCounters:
        return self._combine(other, sign=1.0)

    def _combine(self, other: TransferCounters, *, sign: float) -> TransferCounters:
        return TransferCounters(
            bytes=self.bytes + sign * other.bytes, seconds=self.seconds + sign * other.seconds,
            transfers=self.transfers + sign * other.transfers, failed=self.failed + sign * other.failed,
            external_tokens=self.external_tokens + sign * other.external_tokens,
        )

    @property
    def gbps(self) -> float:
        """Bandwidth while transfers were in flight, GB/s (0 when nothing moved)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def parse_counters(metrics_text: str) -> TransferCounters:
    """Sum the counters over all label sets (one per engine core). Pure."""
    totals = dict.fromkeys(_SAMPLES.values(), 0.0) | {"external_tokens": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in _SAMPLES:
                totals[_SAMPLES[sample.name]] += sample.value
            elif sample.name == _EXTERNAL_TOKENS and sample.labels.get("source") == "external_kv_transfer":
                totals["external_tokens"] += sample.value
    return TransferCounters(**totals)


async def fetch_counters(session: aiohttp.ClientSession, url: str, *, timeout_s: float) -> TransferCounters:
    """GET ``url``/metrics and parse it; raises aiohttp.ClientError or TimeoutError."""
    return parse_counters(await fetch_metrics_text(session, url, timeout_s=timeout_s))


async def fetch_metrics_text(session: aiohttp.ClientSession, url: str, *, timeout_s: float) -> str:
    """The engine's whole ``url``/metrics page; raises aiohttp.ClientError or TimeoutError."""
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
        reply.raise_for_status()
        return await reply.text()
