from __future__ import annotations

import asyncio
import time

import aiohttp

from pdserve.gateway_config import GatewaySpec
from pdserve.role import Role
from pdserve.routing import health
from pdserve.routing.health import record
from pdserve.routing.pool import Endpoint, PairOnly, Pool
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine


def test_a_pair_of_the_pool_is_its_two_endpoints_themselves_with_their_health() -> None:
    """What the orchestrator routes among for a request held to one pair (the gateway's chat warm-up of each pair):
    the other engines are not there to fail over to, and the pair's own health and ejections are the pool's."""
    pool = Pool(prefill_urls=["http://p0", "http://p1"], decode_urls=["http://d0", "http://d1"])
    pair = PairOnly(pool, prefill_url="http://p1", decode_url="http://d0")
    assert pair.all(Role.PREFILL) == [pool.all(Role.PREFILL)[1]] and pair.all(Role.DECODE) == [pool.all(Role.DECODE)[0]]
    assert pair.all(Role.PREFILL)[0] is pool.all(Role.PREFILL)[1]
    pool.all(Role.PREFILL)[1].ejected_until_s = time.monotonic() + 60
    pool.all(Role.DECODE)[0].is_healthy = False
    assert pair.healthy(Role.PREFILL) == pair.healthy(Role.DECODE) == []
    assert [endpoint.url for endpoint in pool.healthy(Role.PREFILL)] == ["http://p0"]


def test_busy_engine_survives_missed_probes_but_dead_one_is_ejected_at_once() -> None:
    busy, dead = Endpoint(Role.DECODE, "busy"), Endpoint(Role.DECODE, "dead")
    for _ in range(2):
        record(busy, "TimeoutError after 5 s", unhealthy_after_failures=3)
    assert busy.is_healthy
    record(busy, "TimeoutError after 5 s", unhealthy_after_failures=3)
    assert not busy.is_healthy
    record(busy, None, unhealthy_after_failures=3)
    assert busy.is_healthy and busy.failed_probes == 0
    record(dead, "unreachable: connection refused", unhealthy_after_failures=3)
    assert not dead.is_healthy


async def test_while_a_role_has_no_healthy_engine_its_engines_are_probed_four_times_a_second() -> None:
    prefill_port, decode_port = free_port(), free_port()
    pool = Pool(prefill_urls=[f"http://127.0.0.1:{prefill_port}"], decode_urls=[f"http://127.0.0.1:{decode_port}"])
    spec = GatewaySpec(health_interval_s=30.0)
    async with serving(FakeEngine().app(), decode_port), aiohttp.ClientSession() as session:
        watcher = asyncio.create_task(health.watch(session, pool, spec=spec))
        try:
            while pool.healthy(Role.PREFILL):  # the first round finds nothing on the prefill port
                await asyncio.sleep(0.01)
            async with serving(FakeEngine().app(), prefill_port):
                started_s = time.monotonic()
                while not pool.healthy(Role.PREFILL):
                    await asyncio.sleep(0.01)
                    assert time.monotonic() - started_s < 2.0, "seen only at the 30 s interval"
        finally:
            watcher.cancel()
