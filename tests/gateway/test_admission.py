"""Admission without HTTP: first come first served, the queue's bounds, the Retry-After estimate."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from pdserve.errors import Overloaded, OverloadReason
from pdserve.gateway.admission import Admission
from pdserve.gateway_config import GatewaySpec
from pdserve.role import Role
from pdserve.routing.pool import Endpoint, Pool


def admission(**limits: Any) -> tuple[Admission, Endpoint]:
    """Admission over a pool of one decode engine, and that engine."""
    pool = Pool(decode_urls=["http://d:1"])
    return Admission(pool, spec=GatewaySpec(**limits)), pool.all(Role.DECODE)[0]


async def test_waiters_get_slots_in_arrival_order() -> None:
    (gate, _), order = admission(max_in_flight=1), []

    async def serve(name: str, release: asyncio.Event) -> None:
        async with gate.gateway_slot():
            order.append(name)
            await release.wait()

    releases = {name: asyncio.Event() for name in "abcd"}
    tasks = []
    for name in "abcd":
        tasks.append(asyncio.create_task(serve(name, releases[name])))
        await asyncio.sleep(0)  # arrive in this order
    for name in "abcd":
        await asyncio.sleep(0.01)
        assert order[-1] == name and gate.queued == 3 - "abcd".index(name)
        releases[name].set()
    await asyncio.gather(*tasks)
    assert gate.in_flight == 0 and gate.queued == 0


async def test_with_no_queue_a_full_gateway_refuses_at_once() -> None:
    gate, _ = admission(max_in_flight=1, max_queued=0)
    async with gate.gateway_slot():
        with pytest.raises(Overloaded) as refused:
            async with gate.gateway_slot():
                pass
    assert refused.value.reason is OverloadReason.QUEUE_FULL and refused.value.retry_after_s == 1
    assert gate.rejected == {OverloadReason.QUEUE_FULL: 1, OverloadReason.QUEUE_TIMEOUT: 0}


async def test_a_request_waits_in_line_for_an_engine_slot_or_times_out() -> None:
    gate, engine = admission(max_in_flight_per_engine=1, queue_timeout_s=0.1)
    with gate.engine_slot(engine):
        with pytest.raises(Overloaded) as refused:
            await gate.engines_with_room(Role.DECODE, lambda: [engine])
        assert refused.value.reason is OverloadReason.QUEUE_TIMEOUT
        waiting = asyncio.create_task(gate.engines_with_room(Role.DECODE, lambda: [engine]))
        await asyncio.sleep(0.01)
        assert gate.queued == 1
    assert await waiting == [engine] and gate.queued == 0
    assert await gate.engines_with_room(Role.DECODE, list) == []  # none left at all: no wait


async def test_a_wait_is_said_in_the_log_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    gate, engine = admission(max_in_flight_per_engine=1, busy_log_interval_s=60.0)
    with caplog.at_level(logging.WARNING, logger="pdserve.gateway.admission"), gate.engine_slot(engine):
        assert await gate.engines_with_room(Role.DECODE, lambda: [engine], over_cap=True) == [engine]  # no wait
        assert caplog.records == []
        waiting = [asyncio.create_task(gate.engines_with_room(Role.DECODE, lambda: [engine])) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert gate.queued == 3
    (said,) = caplog.records  # three waited: one line within the interval
    assert said.getMessage().startswith(
        "requests wait for a decode engine slot (gateway.max_in_flight_per_engine: 1): 1 queued in this gateway process")
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_retry_after_follows_how_long_requests_hold_their_slot() -> None:
    gate, _ = admission()
    assert gate.retry_after_s() == 1  # nothing served yet
    async with gate.gateway_slot():
        await asyncio.sleep(1.2)
    assert gate.retry_after_s() == 2  # rounded up: never sooner than a slot is likely to free
