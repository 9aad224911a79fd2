"""Background probe loop: marks endpoints healthy or not from their ``/health`` answers."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from pdserve.gateway_config import GatewaySpec
from pdserve.role import Role
from pdserve.routing.pool import Endpoint, Pool

log = logging.getLogger(__name__)


async def probe(session: aiohttp.ClientSession, url: str, *, timeout_s: float) -> str | None:
    """None when the engine at ``url`` answers ``GET /health`` with 200 within ``timeout_s``, else why not."""
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
            return None if reply.status == 200 else f"status {reply.status}"
    except aiohttp.ClientConnectorError as exc:
        return f"unreachable: {exc.os_error}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"{type(exc).__name__} after {timeout_s:.0f} s"


def record(endpoint: Endpoint, problem: str | None, *, unhealthy_after_failures: int) -> None:
    """Update ``endpoint`` from one probe; a busy engine may miss a probe or two and stay in."""
    endpoint.failed_probes = 0 if problem is None else endpoint.failed_probes + 1
    is_healthy = problem is None or (endpoint.failed_probes < unhealthy_after_failures and "unreachable" not in problem)
    if is_healthy != endpoint.is_healthy:
        if is_healthy:
            log.info("%s endpoint %s is healthy again", endpoint.role.value, endpoint.url)
            # Back from down (a restarted engine is a new process): the circuit breaker starts over.
            endpoint.failed_legs = endpoint.ejections_in_row = 0
            endpoint.ejected_until_s = 0.0
        else:
            log.warning("%s endpoint %s is UNHEALTHY (%s); no requests go there until it recovers",
                        endpoint.role.value, endpoint.url, problem)
    endpoint.is_healthy = is_healthy


# How often to probe while a role has no healthy engine (the gateway cannot serve yet, as at start):
# an engine that comes up is seen within this, not within health_interval_s.
WAITING_PROBE_INTERVAL_S = 0.25


def next_look_s(pool: Pool, interval_s: float) -> float:
    """How long to wait before looking at the engines again: ``interval_s``, or at most
    WAITING_PROBE_INTERVAL_S while a role has no healthy engine."""
    return interval_s if pool.can_serve else min(interval_s, WAITING_PROBE_INTERVAL_S)


async def watch(session: aiohttp.ClientSession, pool: Pool, *, spec: GatewaySpec) -> None:
    """Probe every endpoint each ``health_interval_s`` (more often while a role has no healthy
    engine), forever; logs every change of state."""
    while True:
        endpoints = pool.all(Role.PREFILL) + pool.all(Role.DECODE)  # the source may have changed them
        problems = await asyncio.gather(*(probe(session, e.url, timeout_s=spec.health_timeout_s) for e in endpoints))
        for endpoint, problem in zip(endpoints, problems, strict=True):
            record(endpoint, problem, unhealthy_after_failures=spec.unhealthy_after_failures)
        await asyncio.sleep(next_look_s(pool, spec.health_interval_s))
