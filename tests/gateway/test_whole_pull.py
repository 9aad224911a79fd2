"""A whole PD reply whose KV pull may hang (gateway/whole_pull.py): which leg answers, and what is
closed. Legs stand in as objects with ``close``; the timing is the test's, the bed's test is real
(tests/e2e/test_netbed.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

import pytest

from pdserve.errors import LegFailed
from pdserve.gateway.decode_leg import DecodeLeg
from pdserve.gateway.whole_pull import first_whole
from pdserve.role import Role


@dataclass
class Leg:
    name: str
    is_closed: bool = False

    def close(self) -> None:
        self.is_closed = True


def after(delay_s: float, leg: Leg | Exception,
          opened: list[Leg] | None = None) -> Callable[[], Coroutine[Any, Any, DecodeLeg]]:
    """A leg opening (its whole reply in) after ``delay_s``, or failing; ``opened`` lists it once it did."""

    async def open_leg() -> DecodeLeg:
        await asyncio.sleep(delay_s)
        if isinstance(leg, Exception):
            raise leg
        if opened is not None:
            opened.append(leg)
        return cast(DecodeLeg, leg)

    return open_leg


async def whole(handoff: Callable[[], Coroutine[Any, Any, DecodeLeg]], *, is_pull_pending: bool,
                local: Callable[[], Awaitable[DecodeLeg]]) -> tuple[Any, bool]:
    task = asyncio.create_task(handoff())
    return await first_whole(task, pull_timeout_s=0.05, is_pull_pending=lambda: is_pull_pending, local=local)


async def test_a_reply_within_the_pull_timeout_is_taken_and_no_local_leg_is_sent() -> None:
    sent: list[Leg] = []
    leg, is_lost = await whole(after(0.01, Leg("handoff")), is_pull_pending=True, local=after(0, Leg("local"), sent))
    assert (leg.name, is_lost, sent) == ("handoff", False, [])


async def test_a_long_reply_with_no_pull_pending_is_waited_for() -> None:
    sent: list[Leg] = []
    leg, is_lost = await whole(after(0.2, Leg("handoff")), is_pull_pending=False, local=after(0, Leg("local"), sent))
    assert (leg.name, is_lost, sent) == ("handoff", False, [])


async def test_a_hung_pull_gives_way_to_the_local_leg_and_is_cancelled() -> None:
    handoff = Leg("handoff")
    opened: list[Leg] = []
    leg, is_lost = await whole(after(3600, handoff, opened), is_pull_pending=True, local=after(0.01, Leg("local")))
    assert (leg.name, is_lost, opened) == ("local", True, [])  # the handoff leg never opened: cancelled


async def test_a_handoff_leg_that_answers_first_wins_and_the_local_leg_is_cancelled() -> None:
    opened: list[Leg] = []
    leg, is_lost = await whole(after(0.1, Leg("handoff")), is_pull_pending=True, local=after(0.2, Leg("local"), opened))
    assert (leg.name, is_lost, opened) == ("handoff", False, [])


async def test_a_local_leg_that_fails_leaves_the_handoff_leg_and_both_failing_raise_the_handoffs_error() -> None:
    failed = LegFailed(Role.DECODE, "http://d", None, "local failed")
    leg, is_lost = await whole(after(0.1, Leg("handoff")), is_pull_pending=True, local=after(0, failed))
    assert (leg.name, is_lost) == ("handoff", False)
    handoff_failed = LegFailed(Role.DECODE, "http://d", 502, "handoff failed")
    with pytest.raises(LegFailed, match="handoff failed"):
        await whole(after(0.1, handoff_failed), is_pull_pending=True, local=after(0, failed))


async def test_a_client_that_leaves_cancels_both_legs() -> None:
    for pull_pending_wait_s in (0.01, 0.2):  # while the handoff leg waits alone, and while both do
        opened: list[Leg] = []
        handoff = asyncio.create_task(after(3600, Leg("handoff"), opened)())
        reply = asyncio.create_task(first_whole(handoff, pull_timeout_s=0.05, is_pull_pending=lambda: True,
                                                local=after(3600, Leg("local"), opened)))
        await asyncio.sleep(pull_pending_wait_s)
        reply.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reply
        assert handoff.cancelled() and opened == []
