"""The gateway's ASGI app: routes, lifespan (HTTP client, pool, health loop), error mapping.

Request shaping lives in pd/, the request flow in orchestrator.py; this module only speaks HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from pdserve.config import Settings
from pdserve.errors import BadRequest, LegFailed, NoHealthyEndpoint, PdserveError, UpstreamRejected
from pdserve.gateway import kv_monitor
from pdserve.gateway.disconnect import ClientDisconnected, DisconnectGuard
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.orchestrator import Call, Mode, Orchestrator, Reply
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

log = logging.getLogger(__name__)
JSON = "application/json"
SCHEMAS: dict[str, type[ChatRequest | CompletionRequest]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
}


class RelayResponse(StreamingResponse):
    """An SSE response that releases the decode leg however the stream ends.

    Streams in the request's own task under a DisconnectGuard instead of Starlette's task group
    (two more tasks and their start-up hops per request, on the way to the first token).
    """

    def __init__(self, reply: Reply, *, headers: dict[str, str]) -> None:
        assert reply.stream is not None
        super().__init__(reply.stream, media_type="text/event-stream", headers=headers)
        self._close = reply.close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            with DisconnectGuard(receive):
                await self.stream_response(send)
        except ClientDisconnected:
            pass  # nobody left to answer; closing the decode leg below aborts it upstream
        finally:
            self._close()


class Gateway:
    """State with a lifecycle: the upstream HTTP session, the endpoint pool and its health loop."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.pool = Pool(
            prefill_urls=settings.endpoint_urls(Role.PREFILL), decode_urls=settings.endpoint_urls(Role.DECODE)
        )
        self._orchestrator: Orchestrator | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        spec = self.settings.gateway
        # Unlimited pooled keep-alive connections: one per concurrent leg, reused across requests.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0)
        # No cookie jar: one engine's Set-Cookie must never ride along on other users' requests,
        # and matching cookies costs time on every leg.
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                         cookie_jar=aiohttp.DummyCookieJar()) as session:
            self._orchestrator = Orchestrator(
                session=session, pool=self.pool, policy=LeastInFlight(), spec=spec,
                connector=self.settings.kv.connector, metrics=self.metrics,
            )
            watchers = [
                asyncio.create_task(health.watch(session, self.pool, spec=spec)),
                asyncio.create_task(kv_monitor.watch(session, self.pool, self.metrics.engine_kv, spec=spec)),
            ]
            try:
                yield
            finally:
                for watcher in watchers:
                    watcher.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)

    async def complete(self, request: Request) -> Response:
        """POST /v1/completions and /v1/chat/completions."""
        path = request.url.path
        mode = Mode.PD
        try:
            mode = _parse_mode(request.headers.get(PD_MODE_HEADER))
            body = parse_json_object(await _read_body(request, limit=self.settings.gateway.max_body_bytes))
            validate_request(body, SCHEMAS[path])
            if body["model"] != self.settings.model.served_name:
                raise BadRequest(f"The model `{body['model']}` does not exist.", status=404,
                                 param="model", code="model_not_found")
            call = Call(path=path, body=body, request_id=request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex,
                        mode=mode, arrived_s=time.perf_counter())
            with DisconnectGuard(request.receive):
                reply = await self._run(call)
        except ClientDisconnected:
            self.metrics.requests.labels(path, mode.value, "499").inc()
            return Response(status_code=499)
        except PdserveError as exc:
            response = error_response(exc)
            self.metrics.requests.labels(path, mode.value, str(response.status_code)).inc()
            return response
        self.metrics.requests.labels(path, mode.value, "200").inc()
        headers = {REQUEST_ID_HEADER: call.request_id}
        if reply.stream is not None:
            return RelayResponse(reply, headers=headers)
        return Response(reply.json_body, media_type=JSON, headers=headers)

    async def _run(self, call: Call) -> Reply:
        assert self._orchestrator is not None, "lifespan not started"
        return await self._orchestrator.run(call)

    async def models(self, _request: Request) -> Response:
        model = self.settings.model
        card = {"id": model.served_name, "object": "model", "created": 0, "owned_by": "pdserve",
                "root": model.path or "pdserve-demo", "max_model_len": model.max_model_len}
        return Response(json.dumps({"object": "list", "data": [card]}), media_type=JSON)

    async def health(self, _request: Request) -> Response:
        """200 while at least one engine of each role answers its health probe."""
        counts = {role.value: len(self.pool.healthy(role)) for role in Role}
        is_ready = all(counts.values())
        return Response(json.dumps({"status": "ok" if is_ready else "degraded", "healthy_engines": counts}),
                        status_code=200 if is_ready else 503, media_type=JSON)

    async def prometheus(self, _request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")


def build_app(settings: Settings) -> Starlette:
    """The gateway as an ASGI app serving ``settings`` (engines must be started elsewhere)."""
    gateway = Gateway(settings)
    routes = [
        Route("/v1/completions", gateway.complete, methods=["POST"]),
        Route("/v1/chat/completions", gateway.complete, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=gateway.lifespan,
                    exception_handlers={HTTPException: _http_error, PdserveError: _pdserve_error})
    app.state.gateway = gateway
    return app


def error_response(exc: PdserveError) -> Response:
    """The one place that maps our exceptions to OpenAI error JSON and an HTTP status."""
    if isinstance(exc, UpstreamRejected):
        return Response(_as_openai_error(exc.body, exc.status), status_code=exc.status, media_type=JSON)
    if isinstance(exc, BadRequest):
        body = error_body(exc.message, type_="invalid_request_error", param=exc.param, code=exc.code)
        return Response(body, status_code=exc.status, media_type=JSON)
    if isinstance(exc, NoHealthyEndpoint):
        return Response(error_body(str(exc), type_="server_error", code="no_healthy_engine"),
                        status_code=503, media_type=JSON)
    if isinstance(exc, LegFailed):
        log.error("%s", exc)
        status = 504 if exc.status is None and "Timeout" in str(exc) else 502
        return Response(error_body(str(exc), type_="server_error", code=f"{exc.role.value}_failed"),
                        status_code=status, media_type=JSON)
    log.exception("unexpected pdserve error", exc_info=exc)
    return Response(error_body(str(exc), type_="server_error"), status_code=500, media_type=JSON)


async def _pdserve_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PdserveError)
    return error_response(exc)


async def _http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    return Response(error_body(exc.detail, type_="invalid_request_error", code=code),
                    status_code=exc.status_code, media_type=JSON)


def _parse_mode(header: str | None) -> Mode:
    if header is None:
        return Mode.PD
    try:
        return Mode(header.strip().lower())
    except ValueError:
        raise BadRequest(f"{PD_MODE_HEADER} must be 'pd' or 'local', not {header!r}",
                         param=PD_MODE_HEADER, code="invalid_header") from None


async def _read_body(request: Request, *, limit: int) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes without buffering them."""
    too_large = BadRequest(f"request body exceeds {limit} bytes", status=413, code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


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
