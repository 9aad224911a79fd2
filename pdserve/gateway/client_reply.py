"""Write a reply on the client's connection: one JSON body (an error with the headers that say how to come
back), or the decode engine's SSE chunks, straight to the transport the server offers where it can."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import TypedDict, cast

from starlette.types import Scope, Send

from pdserve.gateway.call import Reply
from pdserve.gateway.client_errors import ClientError

JSON = "application/json"
# The scope extension under which gateway/server.py offers the client connection's transport.
TRANSPORT_EXTENSION = "pdserve.transport"
_TCP_CORK: int | None = getattr(socket, "TCP_CORK", None)
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close(2) sends a reset and frees the socket's buffer


def error_headers(error: ClientError) -> list[tuple[str, str]]:
    """What tells a client how to come back: the auth scheme after a 401, a wait after a 429 or 503."""
    if error.status == 401:
        return [("www-authenticate", "Bearer")]
    if error.retry_after_s is not None:
        return [("retry-after", str(error.retry_after_s))]
    return []


async def send_error(send: Send, error: ClientError, *, request_id: str) -> None:
    extra = [(name.encode(), value.encode()) for name, value in error_headers(error)]
    if request_id:
        extra.append((b"x-request-id", request_id.encode()))
    await send_whole(send, error.status, error.body(), extra_headers=tuple(extra))


class OfferedConnection(TypedDict, total=False):
    """What gateway/server.py offers of each request's client connection, under TRANSPORT_EXTENSION."""

    transport: asyncio.WriteTransport
    lost: asyncio.Future[None]  # done once the connection is lost


def offered(scope: Scope) -> OfferedConnection:
    """What the server offers of the client's connection; empty where it offers nothing."""
    return cast(OfferedConnection, scope.get("extensions", {}).get(TRANSPORT_EXTENSION, {}))


async def send_reply(send: Send, reply: Reply, *, request_id: str, transport: asyncio.WriteTransport | None) -> None:
    """The decode engine's reply to the client: SSE bytes relayed as they come, or one JSON body.

    Where the server offers its ``transport``, every chunk is written to it at once: the bytes uvicorn
    would write for it, with no ASGI message and no task woken (docs/benchmarks.md, section 1). A client
    that reads slower than the engine writes never holds the engine back: its bytes queue in the transport,
    and the relay ends the stream once more than ``gateway.max_stream_buffer_bytes`` wait there
    (``ClientTransport.cut_off``). A first chunk already in hand takes the response head along in one
    packet (``ClientTransport.hold``). Without the transport, each chunk goes through ``send``, which
    waits for the client to drain its buffer.
    """
    extra = ((b"x-request-id", request_id.encode()),)
    if reply.stream is None:
        assert reply.json_body is not None
        await send_whole(send, 200, reply.json_body, extra_headers=extra)
        return
    message = {"type": "http.response.body", "body": b"", "more_body": True}  # one dict for every chunk
    client = None if transport is None else ClientTransport(transport)
    if client is not None and reply.first_chunk_ready:
        client.hold()
    try:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), *extra]})
        async for chunk in reply.stream(client):
            if client is None:
                message["body"] = chunk
                await send(message)
            else:
                client.write(chunk)
                client.release()  # a held head has gone out with the first chunk
    finally:
        if client is not None:
            client.release()
    await send({"type": "http.response.body", "body": b""})  # after a cut-off, waits at most its grace
    if client is not None:
        client.close_if_cut()


class ClientTransport:
    """The client connection's transport as the relay writes to it: chunks of the chunked body, framed
    here (an empty one is never written: it would read as the body's end)."""

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self._transport = transport
        self._buffered, self._is_closing, self._write = transport.get_write_buffer_size, transport.is_closing, transport.write
        self._is_tls = transport.get_extra_info("sslcontext") is not None  # its socket carries ciphertext only
        self._is_held = False
        self._drop: asyncio.TimerHandle | None = None  # set by cut_off

    def hold(self) -> None:
        """Keep what is written in the socket until ``release``, called once the first chunk is written
        (TCP_CORK, Linux): the response head and the first token then reach the client as one packet,
        one wake-up rather than two."""
        if _TCP_CORK is not None and not self._is_closing():
            self._is_held = self._cork(1)

    def release(self) -> None:
        """Send what ``hold`` kept (the kernel would, at the latest, after 200 ms)."""
        if self._is_held and not self._is_closing():
            self._cork(0)
        self._is_held = False

    def _cork(self, value: int) -> bool:
        assert _TCP_CORK is not None
        try:
            self._transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, _TCP_CORK, value)
        except OSError:  # a connection already reset: what is left of it does not matter
            return False
        return True

    def write_now(self, chunk: bytes) -> bool:
        if not chunk or self._buffered() or self._is_closing():
            return False
        self._write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True

    def write(self, chunk: bytes) -> None:
        """One chunk of the body, behind whatever waits in the buffer; never waits itself."""
        if chunk and not self._is_closing():
            self._write(b"%x\r\n%b\r\n" % (len(chunk), chunk))

    @property
    def buffered_bytes(self) -> int:
        return int(self._buffered())

    def cut_off(self, *, grace_s: float) -> None:
        if self._drop is None:
            self._drop = asyncio.get_running_loop().call_later(grace_s, self._reset)

    def _reset(self) -> None:
        """Drop the connection and all it holds: a plain close would leave the kernel sending on, into a window
        the client keeps shut, for minutes."""
        if not self._is_closing():  # its socket is still the connection's own
            with contextlib.suppress(OSError):
                self._transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                                    _RESET_ON_CLOSE)
        self._transport.abort()

    def close_if_cut(self) -> None:
        """After a cut-off stream's last byte: no next request on this connection. The close sends what waits
        first; the drop ``cut_off`` set stays due, for a client that still takes nothing."""
        if self._drop is not None:
            self._transport.close()

    def write_framed(self, data: bytes) -> None:
        if not self._is_closing():  # a client gone mid-write: nothing more reaches it
            self._write(data)

    @property
    def idle_fd(self) -> int | None:
        if self._buffered() or self._is_closing() or self._is_tls:
            return None
        return int(self._transport.get_extra_info("socket").fileno())


async def send_whole(
    send: Send, status: int, body: bytes, *, extra_headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    headers = [(b"content-type", JSON.encode()), (b"content-length", b"%d" % len(body)), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
