"""Closed-loop streams at a low CPU cost per token: the client of ``bench overhead``'s load processes.

Each stream is one keep-alive connection (a bare asyncio protocol with httptools) that sends its
next request when the previous reply ends. Body bytes are stamped and read in the protocol's own
``data_received``: no task, future or stream reader per chunk, as aiohttp's client has. It records
what runner.send records, the same way (sse.StreamReading). Plain http:// only; no redirects, no TLS.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httptools

from pdserve.bench.records import RequestRecord
from pdserve.bench.runner import Target, client_headers
from pdserve.bench.sse import StreamReading
from pdserve.bench.workload import BenchRequest

_ERROR_BODY_CHARS = 200
_PAUSE_AFTER_FAILURE_S = 0.1  # a dead target must not spin the loop with failed requests


async def run_streams(
    target: Target, requests: Iterator[BenchRequest], *, streams: int, stagger_s: float, stop_s: float,
    timeout_s: float,
) -> list[RequestRecord]:
    """Keep ``streams`` requests in flight until ``stop_s`` (time.perf_counter()); stream j starts
    ``j * stagger_s / streams`` from now and uses ``target.urls[j % len]``. Requests in flight at
    ``stop_s`` finish. Every failure (status, broken stream, timeout) becomes a record's ``error``.
    """
    records: list[RequestRecord] = []

    async def stream(index: int) -> None:
        await asyncio.sleep(index * stagger_s / streams)
        url = target.urls[index % len(target.urls)]
        connection: _Connection | None = None
        try:
            while time.perf_counter() < stop_s:
                if connection is None or not connection.is_open:
                    connection = await _connect(url)
                record = await connection.exchange(target.name, url, next(requests), timeout_s=timeout_s)
                records.append(record)
                if record.error is not None:
                    await asyncio.sleep(_PAUSE_AFTER_FAILURE_S)
        finally:
            if connection is not None:
                connection.close()

    async with asyncio.TaskGroup() as group:
        for index in range(streams):
            group.create_task(stream(index))
    return records


async def _connect(url: str) -> _Connection:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"streams need plain http://host:port URLs, not {url!r}")
    loop = asyncio.get_running_loop()
    headers = b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in client_headers().items())
    connection = _Connection(b"Host: %b\r\n%b" % (parts.netloc.encode("ascii"), headers))
    try:
        await loop.create_connection(lambda: connection, parts.hostname, parts.port or 80)
    except OSError as exc:
        connection.fail(f"{type(exc).__name__}: {exc}")
    return connection


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, headers: bytes) -> None:
        self._headers = headers  # Host and client_headers(), each line ending in CRLF
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self.is_open = False
        self._connect_error: str | None = None
        self._reading = StreamReading()
        self._status = 0
        self._error_body = b""
        self._arrived_s = 0.0  # time.perf_counter() of the bytes being parsed
        self._done: asyncio.Future[None] | None = None

    async def exchange(self, target: str, url: str, request: BenchRequest, *, timeout_s: float) -> RequestRecord:
        """Send ``request`` and read its whole reply; never raises for what the server does."""
        self._reading, self._status, self._error_body = StreamReading(), 0, b""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        timer = loop.call_later(timeout_s, self._time_out, timeout_s)
        sent_s = time.perf_counter()
        if self._connect_error is not None:
            self._reading.error = self._connect_error
            self._done.set_result(None)
        else:
            assert self._transport is not None, "connected"
            payload = json.dumps(request.body).encode()
            self._transport.write(b"POST %b HTTP/1.1\r\n%bContent-Length: %d\r\n\r\n%b" % (
                request.path.encode(), self._headers, len(payload), payload))
        try:
            await self._done
        finally:
            timer.cancel()
            self._done = None
        reading = self._reading
        if self._status not in (0, 200) and reading.error is None:
            reading.error = f"HTTP {self._status}: {self._error_body[:_ERROR_BODY_CHARS].decode(errors='replace')}"
        return RequestRecord(
            target=target, url=url, sent_s=sent_s, token_times_s=tuple(reading.token_times_s),
            done_s=time.perf_counter(), output_tokens=reading.usage_tokens or len(reading.token_times_s),
            error=reading.outcome(),
        )

    def fail(self, error: str) -> None:
        """The connection could not be made: the next exchange records ``error``."""
        self._connect_error = error

    def close(self) -> None:
        self.is_open = False
        if self._transport is not None:
            self._transport.close()

    def _end(self, error: str | None = None) -> None:
        if self._done is None or self._done.done():
            return
        if error is not None:
            self._reading.error = self._reading.error or error
            self.close()  # the connection is in no known state
        self._done.set_result(None)

    def _time_out(self, timeout_s: float) -> None:
        self._end(f"TimeoutError: no complete reply in {timeout_s:g} s")

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass it
        self.is_open = True

    def data_received(self, data: bytes) -> None:
        self._arrived_s = time.perf_counter()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._end(f"unreadable HTTP reply: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_open = False
        self._end(f"ServerDisconnectedError: {exc or 'connection closed'}")

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self._status == 200:
            self._reading.feed(body, now_s=self._arrived_s)
        else:
            self._error_body += body

    def on_message_complete(self) -> None:
        if not self._parser.should_keep_alive():
            self.close()
        self._end()
