"""ClientTransport (gateway/client_reply.py) on a real TCP connection: what ``hold`` keeps back, and when it goes."""

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import AsyncIterator

import pytest

from pdserve.gateway.client_reply import ClientTransport

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_CORK"), reason="TCP_CORK is Linux's")


@pytest.fixture
async def connection() -> AsyncIterator[tuple[asyncio.WriteTransport, socket.socket]]:
    """The server side's transport of one connection, and the client's socket."""
    accepted: asyncio.Future[asyncio.WriteTransport] = asyncio.get_running_loop().create_future()

    async def on_connection(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(writer.transport)  # type: ignore[arg-type]

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    client = socket.create_connection(server.sockets[0].getsockname())
    transport = await accepted
    try:
        yield transport, client
    finally:
        client.close()
        transport.close()
        server.close()


def received_within(client: socket.socket, timeout_s: float) -> bytes:
    readable, _, _ = select.select([client], [], [], timeout_s)
    return client.recv(65536) if readable else b""


async def test_held_bytes_wait_for_the_first_chunk_and_leave_with_it_on_release(
        connection: tuple[asyncio.WriteTransport, socket.socket]) -> None:
    transport, client = connection
    writer = ClientTransport(transport)
    writer.hold()
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")  # as uvicorn writes a response head
    assert received_within(client, 0.05) == b""  # not sent: without hold, the head would be here already
    assert writer.write_now(b"data: 1\n\n")
    writer.release()
    assert received_within(client, 1.0) == b"HTTP/1.1 200 OK\r\n\r\n9\r\ndata: 1\n\n\r\n"
    assert writer.write_now(b"data: 2\n\n") and received_within(client, 1.0) == b"9\r\ndata: 2\n\n\r\n"


async def test_release_sends_what_was_held_when_no_chunk_comes(
        connection: tuple[asyncio.WriteTransport, socket.socket]) -> None:
    transport, client = connection
    writer = ClientTransport(transport)
    writer.hold()
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    writer.release()
    assert received_within(client, 0.1) == b"HTTP/1.1 200 OK\r\n\r\n"  # not the kernel's 200 ms later
