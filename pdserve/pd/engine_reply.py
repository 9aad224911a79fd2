"""One keep-alive connection to an engine and the reply in flight on it: httptools parses what the socket
reads, and the reply hands the body's bytes to the relay (or the relay thread) as they arrive."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httptools

from pdserve.pd.native_relay import Ending, Handback, NativeRelay, Ticket

log = logging.getLogger(__name__)
# Pause reading an engine once this much of its reply waits unread (a slow client must not make
# the gateway buffer a whole generation); resume once the relay has taken it.
_HIGH_WATER_BYTES = 256 * 1024


class EngineUnreachable(ConnectionError):
    """No connection to the engine, or it went away before its reply was complete."""


class EngineReply:
    """One reply: status at once, then the body as it arrives. ``close()`` exactly once."""

    def __init__(self, connection: EngineConnection) -> None:
        self._connection = connection
        self.status = 0
        self._parts: list[bytes] = []
        self._buffered_bytes = 0
        self._is_complete = False
        self._is_closed = False
        self._error: EngineUnreachable | TimeoutError | None = None
        # Where the parser stands in a chunked body: the relay thread may take over only between chunks.
        self.is_chunked = False
        self.in_chunk = False
        self.read_ended_line = False  # the last read ended with CRLF: no chunk header is half-parsed
        self._waiter: asyncio.Future[None] | None = None
        # One idle timer per reply, armed only while the reader waits and moved on lazily, rather
        # than an asyncio.timeout per chunk: that was ~9% of the gateway's CPU at 128 streams.
        self._idle_timeout_s: float | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._last_bytes_s = 0.0  # time.monotonic() of the last body bytes (or of chunks() start)
        self._push: Callable[[bytes], bool] | None = None  # chunks()'s, while it waits

    async def wait_headers(self) -> None:
        while not self.status:
            await self._wait()

    async def read(self, *, idle_timeout_s: float | None = None) -> bytes:
        """The whole body; each wait for more bytes is bounded by ``idle_timeout_s``."""
        if self._is_complete:  # the usual case for a JSON reply: it came with its headers
            return b"".join(self._parts)
        return b"".join([part async for part in self.chunks(idle_timeout_s=idle_timeout_s)])

    async def chunks(
        self, *, idle_timeout_s: float | None = None, first_timeout_s: float | None = None,
        push: Callable[[bytes], bool] | None = None, hand_over: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[bytes]:
        """The body as it arrives: each piece is all that came since the last one (an engine's
        events that reach the gateway together leave it together). Raises EngineUnreachable, or
        TimeoutError once the engine has sent nothing for ``idle_timeout_s`` while we waited
        (``first_timeout_s``, if given, for the first piece: a decode engine's first token waits
        for the KV pull and the engine's queue).

        ``push``: while this waits, each piece goes to ``push`` first, straight from the socket's
        read, with no task woken; a piece it declines (False) is yielded. That is the relay's
        path per token (gateway/relay.py): a task wake and three generators resumed less per chunk.

        ``hand_over``: awaited before each wait, where the relay thread could take the rest of the
        reply (``relay_natively``); True once it did and gave the reply back.
        """
        self._idle_timeout_s = idle_timeout_s if first_timeout_s is None else first_timeout_s
        self._last_bytes_s = time.monotonic()
        self._push = push
        try:
            while True:
                parts = self._parts
                if parts:
                    self._parts = []
                    self._buffered_bytes = 0
                    self._connection.resume_reading()
                    yield parts[0] if len(parts) == 1 else b"".join(parts)
                    self._idle_timeout_s = idle_timeout_s
                elif self._is_complete:
                    return
                elif hand_over is None or not self.may_hand_over or not await hand_over():
                    await self._wait()
        finally:
            self._idle_timeout_s = None
            self._push = None
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None

    def close(self) -> None:
        """Give a finished connection back to the pool; abort an unfinished one (the engine
        sees the disconnect and stops generating). Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        self._connection.finish(reuse=self._is_complete)

    def wait_longer(self) -> None:
        """After ``chunks`` gave up on a silent engine, the next ``chunks`` waits on for its bytes (the
        relay had nowhere to move the stream)."""
        if isinstance(self._error, TimeoutError):  # the relay thread's idle end; the loop's own is not kept
            self._error = None
        self._connection.resume_reading()

    @property
    def may_hand_over(self) -> bool:
        """The parser stands between two chunks of a chunked body with nothing of it unread here."""
        return (self.is_chunked and not self.in_chunk and self.read_ended_line and not self._parts
                and not self._is_complete and self._error is None and self._connection.is_open)

    async def relay_natively(self, native: NativeRelay, client_fd: int, ticket: Ticket) -> Handback | None:
        """The relay thread sends the reply's next chunks straight to ``client_fd``; back at its end or
        at a chunk for Python (pd/native_relay.py), whose bytes this parser then reads as if they
        had just arrived. Only where ``may_hand_over``. None: the thread could not take it (no
        descriptor left to duplicate), and nothing changed."""
        connection = self._connection
        connection.pause_reading()
        try:
            handback = await native.relay(connection.fd, client_fd, ticket)
        except OSError as exc:
            log.warning("the relay thread could not take a stream (%s): relaying it in Python", exc)
            connection.resume_reading()
            return None
        self._last_bytes_s = handback.last_bytes_s
        connection.feed(handback.leftover)
        if handback.ending is Ending.ENGINE_LOST:
            connection.connection_lost(None)  # as the event loop would have said it
            connection.abort()
        elif handback.ending is Ending.IDLE:
            self._error = TimeoutError(f"engine sent nothing for {ticket.idle_timeout_s:.1f} s")
        else:
            connection.resume_reading()
        return handback

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        if self._idle_timeout_s is not None and self._idle_timer is None:
            delay_s = self._last_bytes_s + self._idle_timeout_s - time.monotonic()
            self._idle_timer = loop.call_later(delay_s, self._check_idle)
        self._waiter = loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _check_idle(self) -> None:
        """The idle timer fired: fail the wait if the engine stayed silent long enough, else
        look again when it would have. Not waiting (the client is slow): the next wait re-arms."""
        self._idle_timer = None
        if self._idle_timeout_s is None:
            return
        silent_s = time.monotonic() - self._last_bytes_s
        if silent_s < self._idle_timeout_s:
            self._idle_timer = asyncio.get_running_loop().call_later(self._idle_timeout_s - silent_s, self._check_idle)
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(TimeoutError(f"engine sent nothing for {silent_s:.1f} s"))

    def on_headers(self, status: int) -> None:
        self.status = status
        self._wake()

    def on_body(self, part: bytes) -> None:
        self._last_bytes_s = time.monotonic()
        self._parts.append(part)
        self._buffered_bytes += len(part)
        if self._buffered_bytes > _HIGH_WATER_BYTES:
            self._connection.pause_reading()

    def deliver(self) -> None:
        """After each read from the engine: what it brought goes to ``push`` while the reader
        waits for it, else the reader is woken to take it."""
        parts = self._parts
        if not parts:
            return
        if self._push is not None and self._waiter is not None and not self._waiter.done():
            piece = parts[0] if len(parts) == 1 else b"".join(parts)
            if self._push(piece):
                if self._buffered_bytes > _HIGH_WATER_BYTES:  # on_body paused the engine's socket
                    self._connection.resume_reading()
                self._parts = []
                self._buffered_bytes = 0
                return
            self._parts = [piece]
        self._wake()

    def on_complete(self) -> None:
        self._is_complete = True
        self._wake()

    def on_lost(self, reason: str) -> None:
        if not self._is_complete:
            self._error = EngineUnreachable(reason)
            self._wake()



class EngineConnection(asyncio.Protocol):
    """One TCP connection to an engine; feeds the reply in flight from httptools' callbacks."""

    def __init__(self, release: Callable[[EngineConnection], None]) -> None:
        self._release = release
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._reply: EngineReply | None = None
        self._keep_alive = False
        self._is_paused = False
        self.is_open = False
        self.idle_since_s = 0.0

    def send(self, request: bytes) -> EngineReply:
        assert self._reply is None and self._transport is not None, "one request at a time"
        self._reply = EngineReply(self)
        self._transport.write(request)
        return self._reply

    def finish(self, *, reuse: bool) -> None:
        self._reply = None
        if reuse and self._keep_alive and self.is_open:
            self.resume_reading()
            self.idle_since_s = time.monotonic()
            self._release(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.is_open = False
        if self._transport is not None:
            self._transport.abort()

    def pause_reading(self) -> None:
        if not self._is_paused and self._transport is not None:
            self._is_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._is_paused and self._transport is not None and self.is_open:
            self._is_paused = False
            self._transport.resume_reading()

    @property
    def socket(self) -> Any:
        """The transport's socket (uvloop's stands in for one)."""
        assert self._transport is not None
        return self._transport.get_extra_info("socket")

    @property
    def fd(self) -> int:
        return int(self.socket.fileno())

    def feed(self, data: bytes) -> None:
        """Parse ``data`` as if just read (what the relay thread read and gave back)."""
        if data:
            self.data_received(data)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass it
        self.is_open = True

    def data_received(self, data: bytes) -> None:
        if self._reply is None:
            self.abort()  # bytes nobody asked for: the connection is no longer in a known state
            return
        reply = self._reply
        reply.read_ended_line = data.endswith(b"\r\n")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lose(f"unreadable HTTP reply: {exc}")
            self.abort()
        else:
            reply.deliver()

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_open = False
        if isinstance(exc, OSError) and not isinstance(exc, (ConnectionResetError, BrokenPipeError)):
            self._lose(f"the link to the engine failed: {exc}")  # engine_socket.py's timeout
        else:
            self._lose(f"engine closed the connection: {exc or 'EOF'}")

    def _lose(self, reason: str) -> None:
        if self._reply is not None:
            self._reply.on_lost(reason)

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()
        assert self._reply is not None
        self._reply.on_headers(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        assert self._reply is not None
        self._reply.on_body(body)

    def on_chunk_header(self) -> None:
        assert self._reply is not None
        self._reply.is_chunked = self._reply.in_chunk = True

    def on_chunk_complete(self) -> None:
        assert self._reply is not None
        self._reply.in_chunk = False

    def on_message_complete(self) -> None:
        assert self._reply is not None
        self._reply.on_complete()
