"""Overload over real HTTP: fake engines hold decode requests open while bursts hit the limits."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from pdserve.gateway.app import build_app
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, gateway_settings, post, until_ready

BODY = {"model": MODEL, "prompt": "hi"}
IN_FLIGHT, QUEUED = "pdserve_in_flight", "pdserve_queue_depth"


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    """A fake engine whose decode requests wait for ``decode_gate`` (open until a test closes it)."""
    fake = FakeEngine(decode_gate=asyncio.Event())
    assert fake.decode_gate is not None
    fake.decode_gate.set()  # the gateway's warm-up goes through
    async with serving(fake.app(), free_port()) as url:
        yield fake, url


@asynccontextmanager
async def held_gateway(engine: tuple[FakeEngine, str], **limits: Any) -> AsyncIterator[str]:
    """A ready gateway with ``limits`` in front of ``engine``, whose decode requests are now held."""
    fake, url = engine
    settings = gateway_settings(prefill=[url], decode=[url], **limits)
    async with serving(build_app(settings), settings.gateway.port) as base:
        await until_ready(base)
        assert fake.decode_gate is not None
        fake.decode_gate.clear()
        fake.bodies.clear()
        try:
            yield base
        finally:
            fake.decode_gate.set()  # a request still held would keep the engine from shutting down


async def scrape(base: str) -> dict[str, float]:
    """/metrics as {sample with labels: value}."""
    async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as reply:
        text = await reply.text()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples}


async def until(base: str, check: Callable[[dict[str, float]], bool], *, timeout_s: float = 5.0) -> dict[str, float]:
    for _ in range(int(timeout_s / 0.02)):
        if check(metrics := await scrape(base)):
            return metrics
        await asyncio.sleep(0.02)
    raise AssertionError(f"never reached: {metrics}")


async def assert_idle(base: str) -> None:
    """No request holds a gateway slot, waits in line, or counts on an engine."""
    await until(base, lambda metrics: metrics[IN_FLIGHT] == 0 and metrics[QUEUED] == 0)
    async with aiohttp.ClientSession() as session, session.get(base + "/health") as reply:
        engines = (await reply.json())["engines"]
    assert [endpoint["in_flight"] for role in engines.values() for endpoint in role] == [0, 0]


async def post_with_headers(base: str, body: Any = BODY) -> tuple[int, dict[str, Any], str | None]:
    async with aiohttp.ClientSession() as session, session.post(base + "/v1/completions", json=body) as reply:
        return reply.status, json.loads(await reply.read()), reply.headers.get("Retry-After")


def assert_overloaded(reply: tuple[int, dict[str, Any], str | None]) -> None:
    status, body, retry_after = reply
    assert status == 429 and retry_after is not None and int(retry_after) >= 1
    assert body["error"]["type"] == "rate_limit_exceeded" and body["error"]["code"] == "overloaded"


async def test_a_burst_past_the_limits_gets_429s_and_the_admitted_requests_succeed(
    engine: tuple[FakeEngine, str],
) -> None:
    fake, _ = engine
    async with held_gateway(engine, max_in_flight=2, max_queued=1) as base:
        burst = [asyncio.create_task(post_with_headers(base)) for _ in range(6)]
        await until(base, lambda metrics: metrics[IN_FLIGHT] == 2 and metrics[QUEUED] == 1
                    and sum(task.done() for task in burst) == 3)
        for task in (task for task in burst if task.done()):
            assert_overloaded(task.result())
        assert fake.decode_gate is not None
        fake.decode_gate.set()
        statuses = sorted(status for status, _, _ in await asyncio.gather(*burst))
        assert statuses == [200, 200, 200, 429, 429, 429]
        await assert_idle(base)
        metrics = await scrape(base)
        assert metrics['pdserve_requests_rejected_total{reason="queue_full"}'] == 3
        assert metrics['pdserve_requests_rejected_total{reason="queue_timeout"}'] == 0


async def test_a_queued_request_is_served_once_a_slot_frees(engine: tuple[FakeEngine, str]) -> None:
    fake, _ = engine
    async with held_gateway(engine, max_in_flight=1) as base:
        first = asyncio.create_task(post(base, BODY))
        await until(base, lambda metrics: metrics[IN_FLIGHT] == 1)
        queued = asyncio.create_task(post(base, BODY))
        await until(base, lambda metrics: metrics[QUEUED] == 1)
        assert len(fake.bodies) == 2  # the first request's two legs; the queued one reached no engine
        assert fake.decode_gate is not None
        fake.decode_gate.set()
        assert [status for status, _ in await asyncio.gather(first, queued)] == [200, 200]
        assert len(fake.bodies) == 4
        await assert_idle(base)


async def test_a_queued_request_times_out_with_429(engine: tuple[FakeEngine, str]) -> None:
    fake, _ = engine
    async with held_gateway(engine, max_in_flight=1, queue_timeout_s=0.3) as base:
        first = asyncio.create_task(post(base, BODY))
        await until(base, lambda metrics: metrics[IN_FLIGHT] == 1)
        started_s = time.perf_counter()
        reply = await post_with_headers(base)
        assert time.perf_counter() - started_s >= 0.3
        assert_overloaded(reply)
        assert fake.decode_gate is not None
        fake.decode_gate.set()
        assert (await first)[0] == 200
        await assert_idle(base)
        assert (await scrape(base))['pdserve_requests_rejected_total{reason="queue_timeout"}'] == 1


async def test_a_client_that_disconnects_while_queued_leaves_the_queue(engine: tuple[FakeEngine, str]) -> None:
    fake, _ = engine
    async with held_gateway(engine, max_in_flight=1, max_queued=1) as base:
        first = asyncio.create_task(post(base, BODY))
        await until(base, lambda metrics: metrics[IN_FLIGHT] == 1)
        gone = asyncio.create_task(post(base, BODY))
        await until(base, lambda metrics: metrics[QUEUED] == 1)
        gone.cancel()  # closes its connection
        await until(base, lambda metrics: metrics[QUEUED] == 0)
        later = asyncio.create_task(post(base, BODY))  # its place in the queue is free again
        await until(base, lambda metrics: metrics[QUEUED] == 1)
        assert fake.decode_gate is not None
        fake.decode_gate.set()
        assert [status for status, _ in await asyncio.gather(first, later)] == [200, 200]
        await assert_idle(base)
        metrics = await scrape(base)
        assert metrics['pdserve_requests_total{mode="auto",route="/v1/completions",status="499"}'] == 1
        assert metrics['pdserve_requests_rejected_total{reason="queue_full"}'] == 0


async def test_a_request_waits_for_a_decode_engine_at_its_limit(engine: tuple[FakeEngine, str]) -> None:
    fake, _ = engine
    async with held_gateway(engine, max_in_flight_per_engine=1) as base:
        first = asyncio.create_task(post(base, BODY))
        await until(base, lambda metrics: metrics[IN_FLIGHT] == 1)
        second = asyncio.create_task(post(base, BODY))
        await until(base, lambda metrics: metrics[IN_FLIGHT] == 2 and metrics[QUEUED] == 1)
        assert len(fake.bodies) == 3  # both prefill legs ran (one at a time); one decode leg
        assert fake.decode_gate is not None
        fake.decode_gate.set()
        assert [status for status, _ in await asyncio.gather(first, second)] == [200, 200]
        await assert_idle(base)


async def test_an_engine_error_releases_every_slot(engine: tuple[FakeEngine, str]) -> None:
    fake, _ = engine
    async with held_gateway(engine, max_in_flight=1) as base:
        fake.reject_status = 500
        assert (await post(base, BODY))[0] == 502
        await assert_idle(base)


async def test_an_engine_timeout_releases_every_slot(engine: tuple[FakeEngine, str]) -> None:
    async with held_gateway(engine, max_in_flight=1, request_timeout_s=0.5) as base:
        assert (await post(base, BODY))[0] == 504
        await assert_idle(base)


async def test_a_client_gone_before_its_reply_releases_every_slot(engine: tuple[FakeEngine, str]) -> None:
    async with held_gateway(engine, max_in_flight=1) as base:
        waiting = asyncio.create_task(post(base, BODY))
        await until(base, lambda metrics: metrics[IN_FLIGHT] == 1)
        waiting.cancel()
        await assert_idle(base)


async def test_a_client_gone_midway_through_a_stream_releases_every_slot(engine: tuple[FakeEngine, str]) -> None:
    fake, _ = engine
    async with held_gateway(engine, max_in_flight=1) as base:
        assert fake.decode_gate is not None
        fake.decode_gate.set()
        fake.token_delay_s = 0.3
        async with aiohttp.ClientSession() as session:
            reply = await session.post(base + "/v1/completions", json={**BODY, "stream": True})
            await reply.content.readany()
            reply.close()
        await assert_idle(base)
        assert await fake.closed_early_within() == 1
