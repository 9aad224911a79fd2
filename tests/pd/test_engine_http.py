"""The legs' HTTP client against small scripted servers over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import BinaryIO

import pytest

from pdserve.pd.engine_http import EngineClient
from pdserve.pd.engine_reply import EngineUnreachable

# One request on one connection: read it, answer it (or not); the return says whether to keep serving.
Handler = Callable[[bytes, asyncio.StreamWriter, int], Awaitable[bool]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """One request's head and body, or None at the connection's end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return None
    return head, await reader.readexactly(_content_length(head))


def _content_length(head: bytes) -> int:
    return next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length"))


@dataclass
class Seen:
    """What a scripted server saw: requests per connection, and connections the client closed."""

    requests_per_connection: list[int] = field(default_factory=list)
    closed_by_client: int = 0
    heads: list[bytes] = field(default_factory=list)  # every request's line and headers


@asynccontextmanager
async def scripted_server(handler: Handler) -> AsyncIterator[tuple[str, Seen]]:
    """Serve ``handler`` on a free port; yields the base URL and what the server saw."""
    seen = Seen()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.requests_per_connection.append(0)
        connection = len(seen.requests_per_connection) - 1
        while (request := await _read_request(reader)) is not None:
            head, body = request
            seen.heads.append(head)
            seen.requests_per_connection[connection] += 1
            if not await handler(body, writer, seen.requests_per_connection[connection]):
                break
        else:
            seen.closed_by_client += 1
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}", seen


async def echo_json(body: bytes, writer: asyncio.StreamWriter, _nth: int) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
    return True


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def streaming(events: list[bytes]) -> Handler:
    """An SSE reply sending ``events`` 20 ms apart, chunked, then its end."""

    async def stream(_body: bytes, writer: asyncio.StreamWriter, _nth: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in events:
            await asyncio.sleep(0.02)
            writer.write(chunk(event))
        writer.write(b"0\r\n\r\n")
        return True

    return stream


async def test_sequential_requests_share_one_keep_alive_connection() -> None:
    client = EngineClient(connect_timeout_s=1.0)
    async with scripted_server(echo_json) as (url, seen):
        for index in range(3):
            reply = await client.post(url + "/v1/completions", b'{"n": %d}' % index, headers={"X-Request-Id": "r"})
            assert reply.status == 200 and await reply.read() == b'{"n": %d}' % index
            reply.close()
        assert seen.requests_per_connection == [3]
    client.close()


async def test_a_streamed_reply_arrives_piece_by_piece_and_completes() -> None:
    events = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]

    client = EngineClient(connect_timeout_s=1.0)
    async with scripted_server(streaming(events)) as (url, seen):
        reply = await client.post(url + "/v1/completions", b"{}", headers={})
        pieces = [piece async for piece in reply.chunks(idle_timeout_s=1.0)]
        reply.close()
        assert b"".join(pieces) == b"".join(events) and len(pieces) == len(events)
        second = await client.post(url + "/v1/completions", b"{}", headers={})
        assert await second.read(idle_timeout_s=1.0) == b"".join(events)
        second.close()
        assert seen.requests_per_connection == [2]  # the finished stream's connection was reused
    client.close()


async def test_pieces_go_to_push_while_the_reader_waits_and_those_it_declines_are_yielded() -> None:
    events = [b"data: %d\n\n" % index for index in range(6)]

    pushed: list[bytes] = []

    def push(piece: bytes) -> bool:  # takes the even events, declines the odd ones
        if int(piece.split()[1]) % 2:
            return False
        pushed.append(piece)
        return True

    client = EngineClient(connect_timeout_s=1.0)
    async with scripted_server(streaming(events)) as (url, _):
        reply = await client.post(url + "/v1/completions", b"{}", headers={})
        yielded = [piece async for piece in reply.chunks(idle_timeout_s=1.0, push=push)]
        reply.close()
    client.close()
    assert pushed == events[0::2] and yielded == events[1::2]


async def test_every_request_carries_the_headers_the_client_was_given_once() -> None:
    client = EngineClient(connect_timeout_s=1.0, headers={"Authorization": "Bearer engine-key-0123456789"})
    async with scripted_server(echo_json) as (url, seen):
        for path in ("/v1/completions", "/v1/chat/completions"):
            reply = await client.post(url + path, b"{}", headers={"X-Request-Id": "r"})
            reply.close()
    client.close()
    assert len(seen.heads) == 2
    assert all(head.count(b"\r\nAuthorization: Bearer engine-key-0123456789\r\n") == 1 for head in seen.heads)
    assert all(b"\r\nX-Request-Id: r\r\n" in head for head in seen.heads)


async def test_a_request_written_is_never_sent_again_even_on_a_reused_connection() -> None:
    """The engine read it, then closed the connection without a word: it may be running it (a prefill run twice
    holds its KV twice), so the request fails rather than run again."""
    async def close_on_second_request(body: bytes, writer: asyncio.StreamWriter, nth: int) -> bool:
        return nth != 2 and await echo_json(body, writer, nth)

    client = EngineClient(connect_timeout_s=1.0)
    async with scripted_server(close_on_second_request) as (url, seen):
        (await client.post(url + "/v1/completions", b"{}", headers={})).close()
        with pytest.raises(EngineUnreachable, match="closed the connection"):
            await client.post(url + "/v1/completions", b"{}", headers={})
        assert seen.requests_per_connection == [2]
    client.close()


class EngineClosingIdleConnections:
    """A blocking server on threads that answers each request, then, once told (``close_idle``), closes its side of
    the idle connection, as an engine whose keep-alive timer fired does (its FIN is all a client sees), and counts
    every request it still reads there: one written to a connection the engine had closed."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests_per_connection: list[int] = []
        self._close_idle, self._idle_closed = threading.Event(), threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]

    def close_idle(self) -> None:
        """Blocks the caller's event loop until the engine closed the idle connection: the loop has not read that
        EOF yet when the next request comes, only the kernel has (on loopback the FIN is there once sent)."""
        self._close_idle.set()
        assert self._idle_closed.wait(timeout=10)

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                connection, _ = self.listener.accept()
                self.requests_per_connection.append(0)
                handler = threading.Thread(target=self._serve, args=(connection, len(self._threads) - 1), daemon=True)
                self._threads.append(handler)
                handler.start()

    def _serve(self, connection: socket.socket, index: int) -> None:
        with connection, contextlib.suppress(OSError):
            connection.settimeout(10)
            stream = connection.makefile("rb")
            while head := _read_head(stream):
                stream.read(_content_length(head))
                self.requests_per_connection[index] += 1
                connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                if self._close_idle.wait(timeout=10) and not self._idle_closed.is_set():
                    connection.shutdown(socket.SHUT_WR)
                    self._idle_closed.set()

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[EngineClosingIdleConnections]:
        self._threads[0].start()
        try:
            yield self
        finally:
            self.listener.close()
            await asyncio.to_thread(self._join)  # while the loop closes the client's connections

    def _join(self) -> None:
        for thread in self._threads[1:]:
            thread.join(timeout=10)  # each ends at its connection's end: every request it read is counted


def _read_head(stream: BinaryIO) -> bytes:
    """A request's line and headers, b'' at the connection's end."""
    lines = []
    while (line := stream.readline()) not in (b"", b"\r\n"):
        lines.append(line)
    return b"".join(lines) if line else b""


async def test_an_idle_connection_the_engine_closed_is_dropped_before_reuse_never_written_to() -> None:
    client = EngineClient(connect_timeout_s=1.0)
    async with EngineClosingIdleConnections().serving() as engine:
        reply = await client.post(engine.url + "/v1/completions", b"{}", headers={})
        assert await reply.read(idle_timeout_s=5.0) == b"{}"
        reply.close()  # idle in the client's pool
        engine.close_idle()
        reply = await client.post(engine.url + "/v1/completions", b"{}", headers={})
        assert reply.status == 200 and await reply.read(idle_timeout_s=5.0) == b"{}"
        reply.close()
        client.close()
    assert engine.requests_per_connection == [1, 1]  # the second request went on a new connection, once


async def test_a_fresh_connection_closed_without_a_reply_is_an_error() -> None:
    async def hang_up(_body: bytes, _writer: asyncio.StreamWriter, _nth: int) -> bool:
        return False

    client = EngineClient(connect_timeout_s=1.0)
    async with scripted_server(hang_up) as (url, seen):
        with pytest.raises(EngineUnreachable, match="closed the connection"):
            await client.post(url + "/v1/completions", b"{}", headers={})
        assert seen.requests_per_connection == [1]  # not retried: the engine may have seen it
    client.close()


async def test_an_engine_that_is_not_listening_is_unreachable() -> None:
    async with scripted_server(echo_json) as (url, _):
        pass  # the port is free again
    with pytest.raises(EngineUnreachable, match="cannot connect"):
        await EngineClient(connect_timeout_s=1.0).post(url + "/v1/completions", b"{}", headers={})


async def test_a_silent_stream_times_out_and_closing_it_disconnects_the_engine() -> None:
    async def stall(_body: bytes, writer: asyncio.StreamWriter, _nth: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n"))
        return True  # then waits for the next request, and sees the EOF instead

    client = EngineClient(connect_timeout_s=1.0)
    async with scripted_server(stall) as (url, seen):
        reply = await client.post(url + "/v1/completions", b"{}", headers={})
        pieces = reply.chunks(idle_timeout_s=0.1)
        assert await anext(pieces) == b"data: 1\n\n"
        with pytest.raises(TimeoutError):
            await anext(pieces)
        reply.close()
        for _ in range(100):
            if seen.closed_by_client:
                break
            await asyncio.sleep(0.01)
        assert seen.closed_by_client == 1  # as vLLM aborts a request whose client left
        reply = await client.post(url + "/v1/completions", b"{}", headers={})  # must not reuse the aborted one
        reply.close()
        assert seen.requests_per_connection == [1, 1]
    client.close()


async def test_a_header_with_a_line_break_is_refused_before_sending() -> None:
    async with scripted_server(echo_json) as (url, seen):
        with pytest.raises(ValueError, match="line break"):
            await EngineClient(connect_timeout_s=1.0).post(url + "/x", b"{}", headers={"X-Request-Id": "a\r\nEvil: 1"})
        assert seen.requests_per_connection == []


def test_only_plain_http_engine_urls_are_accepted() -> None:
    with pytest.raises(ValueError, match="plain http"):
        asyncio.run(EngineClient(connect_timeout_s=1.0).post("https://engine:8000/v1/completions", b"{}", headers={}))


async def test_connections_idle_past_keepalive_are_closed_not_reused() -> None:
    client = EngineClient(connect_timeout_s=1.0, keepalive_s=0.05)
    async with scripted_server(echo_json) as (url, seen):
        first, second = [await client.post(url + "/x", b"{}", headers={}) for _ in range(2)]
        first.close()
        second.close()
        busy = await client.post(url + "/x", b"{}", headers={})  # takes the newest; the other idles on
        await asyncio.sleep(0.1)
        busy.close()  # coming back, it finds the other one past its time
        for _ in range(100):
            if seen.closed_by_client:
                break
            await asyncio.sleep(0.01)
        assert seen.requests_per_connection == [1, 2] and seen.closed_by_client == 1
        await asyncio.sleep(0.1)
        again = await client.post(url + "/x", b"{}", headers={})  # everything idle has expired: a new one
        again.close()
        assert seen.requests_per_connection == [1, 2, 1]
    client.close()
