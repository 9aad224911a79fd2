"""The steady part of each stream relayed by a C thread (_chunk_relay.c), not the interpreter.

Python relays each stream's first token, then hands the two sockets to this process's relay
thread, which sends each later chunk on from the engine's socket with no interpreter work
(docs/benchmarks.md, section 1: that per-chunk work put pdserve at 1.6-2.1x nginx's CPU per
chunk). The stream comes back to Python at its end or at the first chunk Python must see (an
error event, the usage event behind a lead, the deadline, a slow client, a broken engine):
``Handback`` says which, with the bytes read and not relayed.

Where the C module was not built (no compiler at install), ``start`` says so once and returns
None: the gateway then relays every chunk in Python (gateway/relay.py's ``push``).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

try:
    from pdserve.pd import _chunk_relay
except ImportError as exc:  # an install without a C compiler: setup.py marks the module optional
    _chunk_relay = None  # type: ignore[assignment]
    _MISSING = str(exc)

# The relay thread's name, as `top -H` shows it and the benchmarks count its CPU (bench/cpu.py); None: no thread.
THREAD_NAME: str | None = None if _chunk_relay is None else _chunk_relay.THREAD_NAME


class Ending(enum.IntEnum):
    """Why the thread gave a stream back (the C module's constants)."""

    END = 0  # the engine's last chunk: the reply is complete once ``leftover`` is parsed
    HANDBACK = 1  # a chunk Python must see (error or usage event, past the deadline, odd framing)
    ENGINE_LOST = 2  # the engine closed the connection or a read failed
    CLIENT_BLOCKED = 3  # the client's socket did not take all of ``unsent``: Python queues it
    IDLE = 4  # the engine sent nothing for the stream's idle timeout
    CANCELLED = 5  # the stream's task was cancelled (its client left): what was relayed comes back


@dataclass(frozen=True, slots=True)
class Handback:
    """A stream back from the thread, with what it relayed meanwhile."""

    ending: Ending
    leftover: bytes  # read from the engine, not relayed: from a chunk boundary, for the HTTP parser
    unsent: bytes  # relayed chunk framing the client's socket did not take: write it before anything else
    payload: bytes  # the relayed chunks' data (SSE events), as the parser would have given them
    token_events: int  # token events relayed (gateway/token_gaps.py): one inter-token gap each
    gap_counts: tuple[int, ...]  # those gaps in ``bounds_s`` buckets, the last +Inf (a burst's events after its
    # first count 0 s: _chunk_relay.c, observe_events)
    gap_sum_s: float
    previous_s: float  # when the last relayed chunk went out (time.perf_counter())
    last_bytes_s: float  # when the engine last sent bytes (time.monotonic())


class RelayCancelled(asyncio.CancelledError):
    """The stream's task was cancelled (its client left, the gateway stopped): ``handback`` says what
    the thread relayed until then, for the request's record."""

    def __init__(self, handback: Handback) -> None:
        super().__init__()
        self.handback = handback


@dataclass(frozen=True, slots=True)
class Ticket:
    """What the thread needs of one stream besides its sockets."""

    previous_s: float  # when the last token event went out: the first gap is measured from it
    deadline_s: float  # the request's deadline (time.perf_counter()): a later chunk comes back
    idle_timeout_s: float
    watch_usage: bool  # give the usage event back (a lead's stream rewrites it: pd/first_token.py)


class NativeRelay:
    """This process's relay thread, woken for handbacks through an eventfd the event loop watches."""

    def __init__(self, bounds_s: Sequence[float]) -> None:
        assert _chunk_relay is not None
        self._loop = asyncio.get_running_loop()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = _chunk_relay.Relay(self._wake_fd, tuple(bounds_s))
        self._waiting: dict[int, asyncio.Future[Handback]] = {}
        self._unclaimed: dict[int, Handback] = {}  # given back as their waiter was cancelled
        self._ids = itertools.count()
        self._loop.add_reader(self._wake_fd, self._take_handbacks)

    async def relay(self, engine_fd: int, client_fd: int, ticket: Ticket) -> Handback:
        """Relay the stream from now until the thread gives it back; cancelled, the thread stops and
        RelayCancelled carries what it relayed (the caller then owns both sockets again: neither is
        read nor written any more)."""
        stream_id = next(self._ids)
        handback: asyncio.Future[Handback] = self._loop.create_future()
        self._waiting[stream_id] = handback
        self._thread.submit(stream_id=stream_id, engine_fd=engine_fd, client_fd=client_fd,
                            previous_s=ticket.previous_s, deadline_s=ticket.deadline_s,
                            idle_timeout_s=ticket.idle_timeout_s, watch_usage=ticket.watch_usage)
        try:
            return await handback
        except asyncio.CancelledError:
            raise RelayCancelled(await self._back_when_cancelled(stream_id, handback)) from None

    async def _back_when_cancelled(self, stream_id: int, waiter: asyncio.Future[Handback]) -> Handback:
        """What the thread relayed of a stream whose task was cancelled. A client that leaves at
        ``data: [DONE]``, before the engine's last chunk, races the thread: the stream is still
        relayed, or ended and not yet taken, or taken as its waiter was cancelled. The thread gives
        a cancelled stream back at once (CANCELLED): this waits only for the event loop's next turn."""
        if waiter.done() and not waiter.cancelled():
            return waiter.result()
        if (back := self._unclaimed.pop(stream_id, None)) is not None:
            return back
        waiter = self._waiting[stream_id] = self._loop.create_future()
        self._thread.cancel(stream_id)
        self._hand_back_finished()
        return await waiter

    def close(self) -> None:
        """Stop the thread; a stream still relayed is dropped, its waiter cancelled."""
        self._loop.remove_reader(self._wake_fd)
        self._thread.close()
        os.close(self._wake_fd)
        for waiter in self._waiting.values():
            waiter.cancel()
        self._waiting.clear()

    def _take_handbacks(self) -> None:
        try:
            os.eventfd_read(self._wake_fd)
        except BlockingIOError:
            return
        self._hand_back_finished()

    def _hand_back_finished(self) -> None:
        """The streams the thread gave back since the last look, each to its waiter, or kept for the
        relay whose waiter was cancelled meanwhile (``_back_when_cancelled`` claims it)."""
        for stream_id, ending, *fields in self._thread.take_finished():
            handback = Handback(Ending(ending), *fields)  # type: ignore[arg-type]  # the C tuple's order
            waiter = self._waiting.pop(stream_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(handback)
            else:
                self._unclaimed[stream_id] = handback


def start(bounds_s: Sequence[float], *, enabled: bool) -> NativeRelay | None:
    """The relay thread, or None (Python relays every chunk): not ``enabled``, or not built here."""
    if not enabled:
        return None
    if _chunk_relay is None:
        log.warning("the C chunk relay was not built with this install (%s): relaying every chunk in Python, "
                    "at about twice the CPU per chunk; install with a C compiler and Python's headers to build it",
                    _MISSING)
        return None
    return NativeRelay(bounds_s)
