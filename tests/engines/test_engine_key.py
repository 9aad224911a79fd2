"""pdserve_vllm/engine_key.py, registered by vLLM's own code (serve/middleware/register.py) from the ``--middleware``
pdserve gives every engine, in front of stand-ins for vLLM's routes: only GET /health answers without the engine key,
and an engine without the key does not start."""

from __future__ import annotations

from argparse import Namespace
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, WebSocket
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect
from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

from pdserve_vllm import ENGINE_KEY_ENV, ENGINE_KEY_MIDDLEWARE
from tests.conftest import free_port

KEY = "e" * 43
# Routes of vLLM 0.32's server, inside and outside vLLM's own guard (authenticate.py, GUARDED_PREFIX = /v1, ...).
ROUTES = [("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/invocations"), ("POST", "/tokenize"),
          ("GET", "/metrics"), ("GET", "/version"), ("GET", "/ping"), ("POST", "/reset_prefix_cache"),
          ("POST", "/health")]


def vllm_app(*, middleware: list[str], api_key: list[str] | None = None) -> FastAPI:
    """A FastAPI app with stand-ins for vLLM's routes, given its middleware by vLLM's own function, from the
    arguments that function reads (register.py: CORS options, api_key, enable_request_id_headers, middleware)."""
    app = FastAPI()
    for method, path in [*ROUTES, ("GET", "/health")]:
        app.add_api_route(path, lambda: {"served": True}, methods=[method])

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_json({"served": True})
        await websocket.close()

    args = Namespace(allowed_origins=["*"], allow_credentials=False, allowed_methods=["*"], allowed_headers=["*"],
                     api_key=api_key, enable_request_id_headers=False, middleware=middleware)
    init_entrypoints_middleware(args, app, supported_tasks=())
    return app


@pytest.fixture
def engine_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(ENGINE_KEY_ENV, KEY)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    return KEY


@pytest.fixture
async def client(engine_key: str) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=vllm_app(middleware=[ENGINE_KEY_MIDDLEWARE]))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as made:
        yield made


@pytest.mark.parametrize(("method", "path"), ROUTES)
async def test_every_route_but_get_health_refuses_a_request_without_the_key(
        client: httpx.AsyncClient, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong-key-of-some-length"}, {"Authorization": f"Basic {KEY}"}):
        reply = await client.request(method, path, headers=headers)
        assert reply.status_code == 401, (headers, reply.text)
        assert reply.headers["www-authenticate"] == "Bearer"
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
        assert KEY not in reply.text
    assert (await client.request(method, path, headers={"Authorization": f"bearer {KEY}"})).json() == {"served": True}


async def test_get_health_answers_without_the_key(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).json() == {"served": True}


async def test_a_cors_preflight_is_refused_too(client: httpx.AsyncClient) -> None:
    """vLLM's own guard lets every OPTIONS through (authenticate.py); no browser has business with an engine."""
    reply = await client.options("/v1/completions", headers={"Origin": "http://evil.example",
                                                              "Access-Control-Request-Method": "POST"})
    assert reply.status_code == 401 and "access-control-allow-origin" not in reply.headers


def test_a_websocket_without_the_key_is_closed_before_it_is_accepted(engine_key: str) -> None:
    with TestClient(vllm_app(middleware=[ENGINE_KEY_MIDDLEWARE])) as client:
        with pytest.raises(WebSocketDisconnect), client.websocket_connect("/v1/realtime"):
            pass
        with client.websocket_connect("/v1/realtime", headers={"Authorization": f"Bearer {KEY}"}) as websocket:
            assert websocket.receive_json() == {"served": True}


async def test_vllms_own_api_key_leaves_every_route_outside_v1_open(engine_key: str) -> None:
    """Why the middleware: vLLM's --api-key alone (authenticate.py, GUARDED_PREFIX)."""
    transport = httpx.ASGITransport(app=vllm_app(middleware=[], api_key=[KEY]))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        assert (await client.post("/v1/completions")).status_code == 401
        for method, path in ROUTES[2:]:
            assert (await client.request(method, path)).status_code == 200, path


@pytest.mark.parametrize("value", [None, "", "s" * 15], ids=["unset", "empty", "short"])
async def test_an_engine_without_the_key_fails_its_start_in_one_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str | None) -> None:
    """Under uvicorn as vLLM runs it (lifespan "auto", serve_http): the app's startup fails, uvicorn exits."""
    if value is None:
        monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(ENGINE_KEY_ENV, value)
    server = uvicorn.Server(uvicorn.Config(vllm_app(middleware=[ENGINE_KEY_MIDDLEWARE]), host="127.0.0.1",
                                           port=free_port(), lifespan="auto", log_config=None))
    with pytest.raises(SystemExit) as exited:
        await server.serve()
    assert exited.value.code == 3  # uvicorn's STARTUP_FAILURE
    refusals = [record.getMessage() for record in caplog.records if ENGINE_KEY_ENV in record.getMessage()]
    assert len(refusals) == 1 and "refuses to start" in refusals[0] and "\n" not in refusals[0]
    assert not server.started


async def test_requests_are_refused_where_no_lifespan_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    transport = httpx.ASGITransport(app=vllm_app(middleware=[ENGINE_KEY_MIDDLEWARE]))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        assert (await client.post("/invocations", headers={"Authorization": "Bearer "})).status_code == 401
        assert (await client.get("/health")).status_code == 200
