"""The gateway's uvicorn server offers the app each request's client transport."""

from __future__ import annotations

import asyncio

import aiohttp
from starlette.types import Receive, Scope, Send

from pdserve.gateway.client_reply import offered
from tests.conftest import free_port, serving


async def test_the_app_is_offered_the_client_transport_and_bytes_written_to_it_arrive() -> None:
    """What the completion routes do per relayed chunk: uvicorn's chunked framing, written directly."""
    transports: list[asyncio.WriteTransport | None] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        transport = offered(scope).get("transport")
        transports.append(transport)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        assert transport is not None
        for part in (b"data: a\n\n", b"data: b\n\n"):
            transport.write(b"%x\r\n%b\r\n" % (len(part), part))
        await send({"type": "http.response.body", "body": b""})

    async with serving(app, free_port()) as url, aiohttp.ClientSession() as session:  # type: ignore[arg-type]
        for _ in range(2):  # and the connection stays usable
            async with session.get(url) as reply:
                assert await reply.read() == b"data: a\n\ndata: b\n\n"
    assert len(transports) == 2 and all(transport is not None for transport in transports)
