"""Scrape the decode engines' KV-transfer counters into the gateway's metrics; warn loudly
when recent transfers ran slower than ``gateway.slow_kv_gbps`` or failed."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from pdserve.config import GatewaySpec
from pdserve.gateway.metrics import EngineKVCollector
from pdserve.pd.transfer_stats import TransferCounters, fetch_counters
from pdserve.role import Role
from pdserve.routing.pool import Pool

log = logging.getLogger(__name__)


def check_window(url: str, window: TransferCounters, *, slow_kv_gbps: float, min_ms: float) -> str | None:
    """A warning for one scrape window of one engine, or None when it looks fine. Pure.

    A few short prompts' KV (0.1 MB) moves at a low GB/s because each transfer costs a fixed
    latency; only transfers that also take ``min_ms`` or more on average count as slow.
    """
    if window.failed > 0:
        return f"decode engine {url}: {window.failed:.0f} KV transfer(s) FAILED; run `pdserve verify`"
    average_ms = window.seconds / window.transfers * 1000 if window.transfers > 0 else 0.0
    if window.transfers > 0 and window.gbps < slow_kv_gbps and average_ms >= min_ms:
        return (f"SLOW KV transfer path to decode engine {url}: {window.transfers:.0f} transfer(s), "
                f"{window.bytes / 1e6:.1f} MB at {window.gbps:.3g} GB/s (< {slow_kv_gbps:g} GB/s), "
                f"{average_ms:.0f} ms each; run `pdserve verify`")
    return None


async def watch(session: aiohttp.ClientSession, pool: Pool, collector: EngineKVCollector, *, spec: GatewaySpec) -> None:
    """Forever: every ``kv_scrape_interval_s`` read each decode engine's counters."""
    while True:
        for endpoint in pool.healthy(Role.DECODE):
            try:
                counters = await fetch_counters(session, endpoint.url, timeout_s=spec.health_timeout_s)
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.debug("no KV counters from %s: %s", endpoint.url, exc)
                continue
            previous = collector.latest.get(endpoint.url)
            collector.latest[endpoint.url] = counters
            warning = previous and check_window(endpoint.url, counters.since(previous), slow_kv_gbps=spec.slow_kv_gbps,
                                                min_ms=spec.slow_kv_min_ms)
            if warning:
                log.warning("%s", warning)
        await asyncio.sleep(spec.kv_scrape_interval_s)
