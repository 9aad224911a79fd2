"""Overload control: bounded requests in flight, for the gateway and per engine, and a bounded
first-come-first-served queue in front of them. Past those bounds a request is refused with
Overloaded (429 and Retry-After), so load never turns into unbounded memory or latency.

Counts are this process's own: each of ``gateway.workers`` has its own slots and queue.
Knows nothing of HTTP; ``app.py`` holds the gateway slot, the orchestrator the engine slots.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

from pdserve.errors import Overloaded, OverloadReason
from pdserve.gateway_config import GatewaySpec
from pdserve.role import Role
from pdserve.routing.pool import Endpoint, Pool

log = logging.getLogger(__name__)
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60
_HOLD_WEIGHT = 0.1  # of the newest request in the running mean of slot hold times


class _Line:
    """Requests waiting, first come first served, for room of one kind (``room``: which, as logged)."""

    def __init__(self, room: str) -> None:
        self.room = room
        self.waiters: deque[asyncio.Event] = deque()

    def wake(self) -> None:
        """Let the first waiter look for room again (it goes back to sleep if there is none)."""
        if self.waiters:
            self.waiters[0].set()


class Admission:
    """Gateway slots (``max_in_flight``), engine slots (``max_in_flight_per_engine``, counted by
    ``Endpoint.in_flight``) and one queue budget (``max_queued``) shared by their lines."""

    def __init__(self, pool: Pool, *, spec: GatewaySpec) -> None:
        self._pool, self._spec = pool, spec
        self._gateway_line = _Line(f"a gateway slot (gateway.max_in_flight: {spec.max_in_flight})")
        self._engine_lines = {role: _Line(f"a {role.value} engine slot (gateway.max_in_flight_per_engine: "
                                          f"{spec.max_in_flight_per_engine})") for role in Role}
        self.in_flight = 0  # requests holding a gateway slot
        self.queued = 0  # requests waiting in any line
        self.rejected = dict.fromkeys(OverloadReason, 0)
        self._hold_s = 0.0  # running mean of how long a request holds its gateway slot
        self._waiting_said_s = -math.inf  # when a wait was last logged

    @asynccontextmanager
    async def gateway_slot(self) -> AsyncIterator[None]:
        """Hold one of the gateway's slots for the block, waiting in line for one first.

        Raises Overloaded when the queue is full or the wait passes ``queue_timeout_s``.
        """
        await self._wait(self._gateway_line, lambda: self.in_flight < self._spec.max_in_flight)
        self.in_flight += 1
        started_s = time.perf_counter()
        try:
            yield
        finally:
            self.in_flight -= 1
            held_s = time.perf_counter() - started_s
            self._hold_s = held_s if self._hold_s == 0.0 else self._hold_s + _HOLD_WEIGHT * (held_s - self._hold_s)
            self._gateway_line.wake()

    async def engines_with_room(self, role: Role, candidates: Callable[[], list[Endpoint]], *,
                                over_cap: bool = False) -> list[Endpoint]:
        """The ``candidates`` (read afresh at each look) with room for one more leg, once any has
        room, waiting in ``role``'s line for it; empty once no candidate is left at all.

        With ``over_cap`` (a request moving off a failed engine) there is no wait: those with room,
        else every candidate. It was admitted once and its slot went with the failed engine;
        queued behind new arrivals, a stream already flowing would end in an error.

        The caller must take its engine slot (``engine_slot``) before it next awaits.
        Raises Overloaded when the queue is full or the wait passes ``queue_timeout_s``.
        """
        def with_room() -> list[Endpoint]:
            return self._with_room(candidates())

        if over_cap:
            return with_room() or candidates()
        line = self._engine_lines[role]
        if line.waiters or not (room := with_room()):
            await self._wait(line, lambda: bool(with_room()) or not candidates())
            room = with_room()
        return room

    def has_room(self, candidates: list[Endpoint]) -> bool:
        """Whether a leg would get one of ``candidates``' slots now: none is waiting, one has room."""
        return bool(candidates) and not self._engine_lines[candidates[0].role].waiters and bool(
            self._with_room(candidates))

    def _with_room(self, candidates: list[Endpoint]) -> list[Endpoint]:
        return [endpoint for endpoint in candidates if endpoint.in_flight < self._spec.max_in_flight_per_engine]

    @contextmanager
    def engine_slot(self, endpoint: Endpoint) -> Iterator[None]:
        """Count one leg on ``endpoint`` for the block; its end lets the next waiter in."""
        try:
            with self._pool.in_flight(endpoint):
                yield
        finally:
            self._engine_lines[endpoint.role].wake()

    def retry_after_s(self) -> int:
        """What a refused client should wait: the mean time a request has held its slot, so that
        by then every request served when it was refused has, on average, finished."""
        return min(max(MIN_RETRY_AFTER_S, math.ceil(self._hold_s)), MAX_RETRY_AFTER_S)

    async def _wait(self, line: _Line, has_room: Callable[[], bool]) -> None:
        """Return once ``has_room()`` and no one waits ahead in ``line``; the caller takes the room
        before it next awaits, so nobody can take it in between."""
        if not line.waiters and has_room():
            return
        if self.queued >= self._spec.max_queued:
            raise self._reject(OverloadReason.QUEUE_FULL)
        turn = asyncio.Event()
        line.waiters.append(turn)
        self.queued += 1
        self._say_waiting(line.room)
        try:
            async with asyncio.timeout(self._spec.queue_timeout_s):
                while not (line.waiters[0] is turn and has_room()):
                    turn.clear()
                    await turn.wait()
        except TimeoutError:
            raise self._reject(OverloadReason.QUEUE_TIMEOUT) from None
        finally:  # served, timed out, or the client left (cancelled): out of the line either way
            line.waiters.remove(turn)
            self.queued -= 1
            line.wake()  # the next may fit too, or the room this one gave up is theirs

    def _say_waiting(self, room: str) -> None:
        """Say that requests queue, once per ``busy_log_interval_s``: their wait adds to TTFT, and
        the queued gauge alone is seen only by those who scrape it."""
        now_s = time.monotonic()
        if now_s - self._waiting_said_s < self._spec.busy_log_interval_s:
            return
        self._waiting_said_s = now_s
        log.warning("requests wait for %s: %d queued in this gateway process, each until one in flight ends "
                    "(its TTFT grows by the wait); add engines or gateway processes, or raise the limit if "
                    "the engines have room", room, self.queued)

    def _reject(self, reason: OverloadReason) -> Overloaded:
        self.rejected[reason] += 1
        return Overloaded(reason, retry_after_s=self.retry_after_s())
