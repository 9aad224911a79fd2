"""A client that reads slower than the engine writes (gateway.max_stream_buffer_bytes), over real sockets: the
gateway keeps reading the engine, holds at most the cap for the client, then ends the stream with an error event
that says why and aborts the decode leg; a client that then takes nothing is dropped after its grace."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from pdserve.gateway.client_reply import ClientTransport
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL
from tests.gateway.test_faults import gateway_over

CAP_BYTES = 256 * 1024
WORDS = [f" w{index:05d}" + "x" * 300 for index in range(60_000)]  # 18 MB: far more than the sockets' buffers hold


@asynccontextmanager
async def stalled_client(base: str, fake: FakeEngine) -> AsyncIterator[socket.socket]:
    """A streamed completion of WORDS (from ``fake``, once the gateway's warm-up is done) sent on a socket that then
    reads nothing: its receive buffer as small as the kernel allows, so the gateway's writes back up at once."""
    fake.words = WORDS
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window it offers
    sock.setblocking(False)
    host, port = base.removeprefix("http://").split(":")
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": len(WORDS), "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    await asyncio.get_running_loop().sock_sendall(sock, head + body)
    try:
        yield sock
    finally:
        sock.close()


async def read_to_end(sock: socket.socket, *, timeout_s: float = 30.0) -> tuple[bytes, bool]:
    """Everything the gateway sends until it closes the connection: (bytes, whether it was reset)."""
    loop, received = asyncio.get_running_loop(), bytearray()
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                data = await loop.sock_recv(sock, 1 << 20)
            except ConnectionResetError:
                return bytes(received), True
            if not data:
                return bytes(received), False
            received += data


@pytest.fixture
def peak_buffered(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The most bytes any client transport held after a write."""
    peak = [0]
    write = ClientTransport.write

    def counted(self: ClientTransport, chunk: bytes) -> None:
        write(self, chunk)
        peak[0] = max(peak[0], self.buffered_bytes)

    monkeypatch.setattr(ClientTransport, "write", counted)
    return peak


@pytest.mark.parametrize("native_relay", [True, False])
async def test_a_client_that_stops_reading_gets_an_error_event_and_its_decode_leg_is_aborted(
        native_relay: bool, peak_buffered: list[int]) -> None:
    fake = FakeEngine()
    async with gateway_over([fake], [fake], native_relay=native_relay, max_stream_buffer_bytes=CAP_BYTES,
                            idle_timeout_s=60.0) as base, stalled_client(base, fake) as sock:
        # Nothing read yet: the engine's stream is aborted all the same, long before its end.
        assert await fake.closed_early_within(30.0) == 1
        payload, was_reset = await read_to_end(sock)
    start = payload.index(b'data: {"error"') + len(b"data: ")
    error = json.loads(payload[start:payload.index(b"\n\n", start)])["error"]
    assert error["code"] == "client_too_slow" and "too slowly" in error["message"]
    assert not was_reset and payload.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # the chunked body ends whole
    assert len(payload) < sum(map(len, WORDS)) // 2  # it ended early
    # What waited in the gateway for the client: the cap, plus at most the engine reads behind one chunk.
    assert peak_buffered[0] <= CAP_BYTES + 512 * 1024


async def test_a_client_that_takes_nothing_after_the_error_event_is_dropped_after_its_grace() -> None:
    fake = FakeEngine()
    async with gateway_over([fake], [fake], max_stream_buffer_bytes=CAP_BYTES, idle_timeout_s=0.5) as base, \
            stalled_client(base, fake) as sock:
        assert await fake.closed_early_within(30.0) == 1
        # Still reading nothing: the gateway resets the connection, dropping what it held for the client.
        for _ in range(1500):
            if tcp_state(sock) == TCP_CLOSE:
                break
            await asyncio.sleep(0.02)
        assert tcp_state(sock) == TCP_CLOSE


TCP_CLOSE = 7  # include/net/tcp_states.h: what a socket that received a reset is in


def tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of ``sock`` (struct tcp_info's first byte, Linux), read without reading any data."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
