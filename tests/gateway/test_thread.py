from __future__ import annotations

import socket

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pdserve.errors import EngineStartFailed
from pdserve.gateway.thread import GatewayThread
from tests.conftest import free_port


def hello_app() -> Starlette:
    return Starlette(routes=[Route("/", lambda _request: PlainTextResponse("hi"))])


def test_serves_from_its_own_thread_until_stopped() -> None:
    port = free_port()
    server = GatewayThread(hello_app(), host="127.0.0.1", port=port)
    server.start(timeout_s=10)
    assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text == "hi"
    server.check()
    server.stop()
    with pytest.raises(EngineStartFailed):
        server.check()


def test_a_taken_port_is_a_clear_start_error() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(EngineStartFailed, match=f"127.0.0.1:{port}"):
            GatewayThread(hello_app(), host="127.0.0.1", port=port).start(timeout_s=10)
