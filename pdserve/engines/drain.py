"""An engine's load read from its own /metrics, and the wait, once it has left the gateway's pool,
until it holds nothing: stopping it then loses no request. Only reads; the caller stops it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import aiohttp

from pdserve.pd.transfer_stats import fetch_metrics_text
from pdserve.routing.load import EngineLoad, parse_engine_load

DRAIN_GRACE_S = 1.0  # a request the gateway chose the engine for just before it left the pool reaches it by then
DRAIN_POLL_S = 0.5
IDLE_READS = 2  # in a row: one read can fall between a request finishing and the next one arriving


async def read_load(session: aiohttp.ClientSession, url: str, *, timeout_s: float) -> EngineLoad:
    """One read of the engine at ``url``; raises aiohttp.ClientError or TimeoutError."""
    return parse_engine_load(await fetch_metrics_text(session, url, timeout_s=timeout_s), read_s=time.monotonic())


async def wait_until_idle(session: aiohttp.ClientSession, url: str, *, is_running: Callable[[], bool],
                          timeout_s: float, read_timeout_s: float) -> bool:
    """Wait, at most ``timeout_s``, until the engine at ``url`` holds no request and no KV block
    (EngineLoad.is_idle) on IDLE_READS reads in a row, or has exited (``is_running``): its streams
    run to their end, and a prefill engine's handoffs are pulled. Returns False when time ran out."""
    idle_reads, pause_s = 0, DRAIN_GRACE_S
    try:
        async with asyncio.timeout(timeout_s):
            while is_running() and idle_reads < IDLE_READS:
                await asyncio.sleep(pause_s)
                idle_reads = idle_reads + 1 if await _reads_idle(session, url, timeout_s=read_timeout_s) else 0
                pause_s = DRAIN_POLL_S
    except TimeoutError:
        return False
    return True


async def _reads_idle(session: aiohttp.ClientSession, url: str, *, timeout_s: float) -> bool:
    """A missed read counts as busy: a busy engine can be slow to answer."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        return (await read_load(session, url, timeout_s=timeout_s)).is_idle
    return False
