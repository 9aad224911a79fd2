"""The gateway's ASGI app: routes, lifespan (HTTP client, pool, health loop), error mapping.

Request shaping lives in pd/, the request flow in orchestrator.py; this module only speaks HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdserve.config import Settings
from pdserve.errors import BadRequest, LegFailed, NoHealthyEndpoint, PdserveError, UpstreamRejected
from pdserve.gateway import kv_monitor
from pdserve.gateway.disconnect import ClientDisconnected, DisconnectGuard
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.orchestrator import Call, Mode, Orchestrator, Reply
from pdserve.pd.engine_http import EngineClient
from pdserve.protocol import (
    PD_MODE_HEADER,
    REQUEST_ID_HEADER,
    ChatRequest,
    CompletionRequest,
    error_body,
    parse_json_object,
    validate_request,
)
from pdserve.role import Role
from pdserve.routing import health
from pdserve.routing.policy import LeastInFlight
from pdserve.routing.pool import Pool
from pdserve.routing.sources import EndpointSource, FixedEndpoints

log = logging.getLogger(__name__)
JSON = "application/json"
_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,256}")
SCHEMAS: dict[str, type[ChatRequest | CompletionRequest]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
}


class Gateway:
    """State with a lifecycle: the upstream HTTP session, the endpoint pool and its health loop."""

    def __init__(self, settings: Settings, source: EndpointSource) -> None:
        self.settings, self.source = settings, source
        self.metrics = GatewayMetrics()
        self.pool = Pool()
        self._orchestrator: Orchestrator | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        spec = self.settings.gateway
        # The legs get their own lean client (pd/engine_http.py); health probes and metrics
        # scrapes use aiohttp. No cookie jar: an engine's Set-Cookie must never ride along.
        client = EngineClient(connect_timeout_s=spec.connect_timeout_s)
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            self._orchestrator = Orchestrator(
                client=client, pool=self.pool, policy=LeastInFlight(), spec=spec,
                connector=self.settings.kv.connector, metrics=self.metrics,
            )
            watchers = [
                asyncio.create_task(self.source.follow(self.pool)),
                asyncio.create_task(health.watch(session, self.pool, spec=spec)),
                asyncio.create_task(kv_monitor.watch(session, self.pool, self.metrics.engine_kv, spec=spec)),
            ]
            await asyncio.sleep(0)  # the source fills the pool before the first request
            try:
                yield
            finally:
                for watcher in watchers:
                    watcher.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)
                client.close()

    async def complete(self, scope: Scope, receive: Receive, send: Send) -> None:
        """POST /v1/completions and /v1/chat/completions, as plain ASGI: these routes carry every
        token, so they skip Starlette's middleware and its wrappers around each ``send``."""
        path, mode, status = scope["path"], Mode.PD, 500
        headers = _header_map(scope)
        try:
            mode = _parse_mode(headers.get(b"x-pd-mode"))
            call = Call(path=path, body=await self._read_request(path, headers, receive), mode=mode,
                        request_id=_request_id(headers.get(b"x-request-id")), arrived_s=time.perf_counter())
            with DisconnectGuard(receive):
                reply = await self._run(call)
                status = 200  # from here on, failures reach the client inside the stream
                try:
                    await _send_reply(send, reply, request_id=call.request_id)
                finally:
                    reply.close()
        except ClientDisconnected:
            if status != 200:
                status = 499  # gone before its reply started
        except PdserveError as exc:
            status, body = error_response(exc)
            await _send_whole(send, status, body)
        finally:
            self.metrics.requests.labels(path, mode.value, str(status)).inc()

    async def _read_request(self, path: str, headers: dict[bytes, bytes], receive: Receive) -> dict[str, Any]:
        """The validated JSON body; raises BadRequest (400, 404 for an unknown model, 413)."""
        body = parse_json_object(await _read_body(receive, headers, limit=self.settings.gateway.max_body_bytes))
        validate_request(body, SCHEMAS[path])
        if body["model"] != self.settings.model.served_name:
            raise BadRequest(f"The model `{body['model']}` does not exist.", status=404,
                             param="model", code="model_not_found")
        return body

    async def _run(self, call: Call) -> Reply:
        assert self._orchestrator is not None, "lifespan not started"
        return await self._orchestrator.run(call)

    async def models(self, _request: Request) -> Response:
        model = self.settings.model
        card = {"id": model.served_name, "object": "model", "created": 0, "owned_by": "pdserve",
                "root": model.path or "pdserve-demo", "max_model_len": model.max_model_len}
        return Response(json.dumps({"object": "list", "data": [card]}), media_type=JSON)

    async def health(self, _request: Request) -> Response:
        """200 while at least one engine of each role answers its health probe; lists every engine."""
        counts = {role.value: len(self.pool.healthy(role)) for role in Role}
        engines = {role.value: [{"url": endpoint.url, "is_healthy": endpoint.is_healthy, "in_flight": endpoint.in_flight,
                                 "kv_backends": endpoint.kv_backends, "kv_transports": endpoint.kv_transports}
                                for endpoint in self.pool.all(role)] for role in Role}
        is_ready = all(counts.values())
        body = {"status": "ok" if is_ready else "degraded", "healthy_engines": counts, "engines": engines}
        return Response(json.dumps(body), status_code=200 if is_ready else 503, media_type=JSON)

    async def prometheus(self, _request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")


class GatewayApp:
    """The ASGI app: the two completion routes go straight to the gateway, the rest (models,
    health, metrics, the lifespan, 404/405) through Starlette."""

    def __init__(self, gateway: Gateway, rest: Starlette) -> None:
        self._gateway, self._rest = gateway, rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in SCHEMAS:
            await self._rest(scope, receive, send)
        elif scope["method"] == "POST":
            await self._gateway.complete(scope, receive, send)
        else:
            body = error_body("Method Not Allowed", type_="invalid_request_error", code="method_not_allowed")
            await _send_whole(send, 405, body, extra_headers=((b"allow", b"POST"),))


def build_app(settings: Settings, source: EndpointSource | None = None) -> GatewayApp:
    """The gateway as an ASGI app serving ``settings`` (engines must be started elsewhere).

    Its engines come from ``source``; by default the configured ones (launched here, or urls).
    """
    gateway = Gateway(settings, source or FixedEndpoints(
        prefill_urls=settings.endpoint_urls(Role.PREFILL), decode_urls=settings.endpoint_urls(Role.DECODE)))
    routes = [
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
    ]
    rest = Starlette(routes=routes, lifespan=gateway.lifespan, exception_handlers={HTTPException: _http_error})
    return GatewayApp(gateway, rest)


def error_response(exc: PdserveError) -> tuple[int, bytes]:
    """The one place that maps our exceptions to an HTTP status and OpenAI error JSON."""
    if isinstance(exc, UpstreamRejected):
        return exc.status, _as_openai_error(exc.body, exc.status)
    if isinstance(exc, BadRequest):
        return exc.status, error_body(exc.message, type_="invalid_request_error", param=exc.param, code=exc.code)
    if isinstance(exc, NoHealthyEndpoint):
        return 503, error_body(str(exc), type_="server_error", code="no_healthy_engine")
    if isinstance(exc, LegFailed):
        log.error("%s", exc)
        return 504 if exc.is_timeout else 502, error_body(str(exc), type_="server_error", code=f"{exc.role.value}_failed")
    log.exception("unexpected pdserve error", exc_info=exc)
    return 500, error_body(str(exc), type_="server_error")


async def _http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    return Response(error_body(exc.detail, type_="invalid_request_error", code=code),
                    status_code=exc.status_code, media_type=JSON)


def _parse_mode(header: bytes | None) -> Mode:
    if header is None:
        return Mode.PD
    value = header.decode("latin-1")
    try:
        return Mode(value.strip().lower())
    except ValueError:
        raise BadRequest(f"{PD_MODE_HEADER} must be 'pd' or 'local', not {value!r}",
                         param=PD_MODE_HEADER, code="invalid_header") from None


def _header_map(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by lower-case name (ASGI servers already lower-case them)."""
    return dict(scope["headers"])


def _request_id(header: bytes | None) -> str:
    """The client's X-Request-Id, or a fresh one; it goes into engine requests and logs."""
    if header is None:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(header):
        raise BadRequest(f"{REQUEST_ID_HEADER} must be 1-256 visible ASCII characters", param=REQUEST_ID_HEADER,
                         code="invalid_header")
    return header.decode("ascii")


async def _read_body(receive: Receive, headers: dict[bytes, bytes], *, limit: int) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes without buffering them."""
    too_large = BadRequest(f"request body exceeds {limit} bytes", status=413, code="request_too_large")
    declared = headers.get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size, more_body = [], 0, True
    while more_body:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        more_body = message.get("more_body", False)
    return b"".join(chunks)


async def _send_reply(send: Send, reply: Reply, *, request_id: str) -> None:
    """The decode engine's reply to the client: SSE bytes relayed as they come, or one JSON body."""
    extra = ((b"x-request-id", request_id.encode()),)
    if reply.stream is None:
        assert reply.json_body is not None
        await _send_whole(send, 200, reply.json_body, extra_headers=extra)
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), *extra]})
    async for chunk in reply.stream:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _send_whole(
    send: Send, status: int, body: bytes, *, extra_headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    headers = [(b"content-type", JSON.encode()), (b"content-length", b"%d" % len(body)), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _as_openai_error(body: bytes, status: int) -> bytes:
    """Engines already answer in OpenAI error format; wrap anything else so clients can parse it."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return body
    message = parsed.get("message") if isinstance(parsed, dict) else body.decode(errors="replace")
    return error_body(str(message or f"engine returned status {status}"), type_="invalid_request_error")
