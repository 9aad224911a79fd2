"""The gateway sends the engine key (pdserve/engine_key.py) on every call to an engine, over real HTTP against a
fake engine: the legs, warm-ups, health probes, metrics scrapes and model cards; and never to a client."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.gateway.app import build_app
from pdserve_vllm import ENGINE_KEY_ENV
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, gateway_settings, until_ready

KEY = "engine-key-for-the-gateway-0123"
ENGINE_PATHS = {"/health", "/metrics", "/v1/models", "/v1/completions"}


class SeenAuthorization:
    """ASGI middleware in front of the fake engine: each request's path and Authorization header."""

    def __init__(self, app: ASGIApp, seen: list[tuple[str, bytes | None]]) -> None:
        self._app, self._seen = app, seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self._seen.append((scope["path"], dict(scope["headers"]).get(b"authorization")))
        await self._app(scope, receive, send)


async def test_every_call_to_an_engine_carries_the_key_and_no_reply_to_a_client_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_KEY_ENV, KEY)  # `pdserve serve` in front of running engines takes it from here
    seen: list[tuple[str, bytes | None]] = []
    engine = FakeEngine().app()
    engine.add_middleware(SeenAuthorization, seen=seen)
    async with serving(engine, free_port()) as url:
        settings = gateway_settings(prefill=[url], decode=[url], kv_scrape_interval_s=0.1)
        async with serving(build_app(settings), settings.gateway.port) as base, aiohttp.ClientSession() as client:
            await until_ready(base)  # the warm-ups went through both legs
            async with client.get(base + "/v1/models") as reply:
                models = (reply.status, dict(reply.headers), await reply.read())
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}
            async with client.post(base + "/v1/completions", data=json.dumps(body)) as reply:
                completion = (reply.status, dict(reply.headers), await reply.read())
            async with asyncio.timeout(30):
                while not ENGINE_PATHS <= {path for path, _ in seen}:  # the scrapes come on their own time
                    await asyncio.sleep(0.05)
    assert {authorization for _, authorization in seen} == {f"Bearer {KEY}".encode()}
    for status, headers, payload in (models, completion):
        assert status == 200 and KEY.encode() not in payload and not any(KEY in value for value in headers.values())
