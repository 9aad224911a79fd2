"""Build the gateway's ASGI app: the completion routes as plain ASGI, the rest on Starlette, and the lifespan
(HTTP client, pool, health loop, warm-up). Request shaping lives in pd/, the request flow in orchestrator.py,
what a failure tells the client in client_errors.py, writing the reply in client_reply.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdserve.access import Access, AccessKeys
from pdserve.config import Settings
from pdserve.engine_key import EngineKey, engine_session, load_engine_key
from pdserve.engines.members import MembersFolder
from pdserve.errors import BadRequest, NotReady, PdserveError
from pdserve.gateway import dashboard, readiness, tracing
from pdserve.gateway.admin_routes import AdminRoutes
from pdserve.gateway.admission import Admission
from pdserve.gateway.call import Call, Reply
from pdserve.gateway.client_errors import client_error
from pdserve.gateway.client_reply import JSON, error_headers, offered, send_error, send_reply, send_whole
from pdserve.gateway.disconnect import ClientDisconnected, DisconnectGuard
from pdserve.gateway.exposure import gateway_keys
from pdserve.gateway.handoffs import Handoffs
from pdserve.gateway.key_limits import KeyLimits, requested_tokens
from pdserve.gateway.kv_monitor import KVMonitor
from pdserve.gateway.media_urls import check_media_urls
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.model_card import ModelCards, without_path
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.recent import RecentRequests
from pdserve.gateway.request_input import (
    authorization,
    check_header_size,
    header_map,
    read_body,
    request_id,
)
from pdserve.gateway.schema_limits import check_schemas
from pdserve.gateway.tenants import CacheSalts, requested_mode
from pdserve.gateway.workers import Worker
from pdserve.pd import native_relay
from pdserve.pd.engine_http import EngineClient
from pdserve.protocol import ChatRequest, CompletionRequest, error_body, parse_json_object, validate_request
from pdserve.role import Role
from pdserve.routing import health
from pdserve.routing.decision import Mode
from pdserve.routing.pool import Pool
from pdserve.routing.router import Router
from pdserve.routing.sources import EndpointSource, FixedEndpoints, LaunchedEngines

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

SCHEMAS: dict[str, type[ChatRequest | CompletionRequest]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
}


class Gateway:
    """State with a lifecycle: the upstream HTTP session, the endpoint pool, its health loop and warm-up."""

    def __init__(self, settings: Settings, source: EndpointSource, keys: AccessKeys, *, engine_key: EngineKey,
                 worker: Worker | None = None, members: MembersFolder | None = None,
                 span_exporter: SpanExporter | None = None) -> None:
        self.settings, self.source, self.keys = settings, source, keys
        self._engine_key = engine_key  # sent to engines on every call, never to clients
        self._span_exporter, self._tracing = span_exporter, tracing.OFF  # started with the lifespan
        self._worker = worker  # one of several processes on the port (gateway/workers.py), or None
        self.pool = Pool()
        self.admission = Admission(self.pool, spec=settings.gateway)
        self.key_limits, self._salts = KeyLimits(settings.access), CacheSalts(keys)
        self.metrics = GatewayMetrics(self.pool, self.admission)
        self.readiness = readiness.Readiness()
        self.recent = RecentRequests()  # the live page's list, filled by the orchestrator
        self.admin = AdminRoutes(settings, self.pool, keys, metrics=self.metrics, recent=self.recent,
                                 worker=worker, members=members)
        # Each process's prefix index sees only its own requests: it keeps its share of each engine's cache.
        self.router = Router(settings.routing, gateway_processes=settings.gateway.workers if worker is not None else 1)
        self._orchestrator: Orchestrator | None = None
        self._model_cards: ModelCards | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        spec = self.settings.gateway
        # The legs get their own lean client (pd/engine_http.py); health probes, metrics scrapes and model cards
        # use aiohttp. Both carry the engine key on every request.
        client = EngineClient(connect_timeout_s=spec.connect_timeout_s, link_timeout_s=spec.link_timeout_s,
                              headers=self._engine_key.headers())
        async with engine_session(self._engine_key) as session:
            handoffs = Handoffs(slow_s=spec.slow_handoff_warn_s)
            self._model_cards = ModelCards(session, settings=self.settings)
            monitor = KVMonitor(spec=spec, handoffs=handoffs, collector=self.metrics.engine_kv,
                                load_interval_s=self.settings.routing.load_scrape_interval_s)
            cards = self._model_cards
            native = native_relay.start(self.metrics.modes[Mode.PD.value].itl.bounds_s, enabled=spec.native_relay)
            self._orchestrator = Orchestrator(
                client=client, pool=self.pool, admission=self.admission, router=self.router, spec=spec,
                connector=self.settings.kv.connector, metrics=self.metrics, handoffs=handoffs, recent=self.recent,
                max_model_len=lambda: cards.max_model_len, native=native,
                decode_forces_first_token=self.settings.decode.forces_first_token,
                engines_parse_chat=self.settings.prefill.parses_chat or self.settings.decode.parses_chat,
                tool_call_parser=self.settings.decode.tool_call_parser or self.settings.prefill.tool_call_parser,
                hides_cached_tokens=not self.settings.access.show_cached_tokens,
            )
            watchers = [
                asyncio.create_task(self.source.follow(self.pool)),
                asyncio.create_task(cards.fetch_once_up(self.pool, interval_s=spec.health_interval_s)),
                *self._engine_watchers(session, monitor),
                asyncio.create_task(readiness.keep_warm(self._orchestrator, self.pool, self.readiness,
                                                        warm_pair=readiness.pair_warmer(client, kv=self.settings.kv),
                                                        model=self.settings.model.served_name,
                                                        interval_s=spec.health_interval_s)),
            ]
            self._tracing = tracing.start(spec.otlp_traces_endpoint, exporter=self._span_exporter)
            await asyncio.sleep(0)  # the source fills the pool before the first request
            try:
                yield
            finally:
                for watcher in watchers:
                    watcher.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)
                await self._orchestrator.close()
                client.close()
                if native is not None:
                    native.close()
                await asyncio.to_thread(self._tracing.shutdown)  # exports what is queued

    def _engine_watchers(self, session: aiohttp.ClientSession, monitor: KVMonitor) -> list[asyncio.Task[None]]:
        """Health probes and KV scrapes, run by one process only: this one, or worker 0 of several,
        which shares health with the others; every worker answers for its own metrics."""
        spec, worker = self.settings.gateway, self._worker
        if worker is None:
            return [asyncio.create_task(health.watch(session, self.pool, spec=spec)),
                    asyncio.create_task(monitor.watch(session, self.pool))]
        tasks = [asyncio.create_task(worker.serve_metrics(self.metrics.render))]
        if not worker.probes:
            return [*tasks, asyncio.create_task(worker.health.follow(self.pool, worker=worker.index))]
        return [*tasks, asyncio.create_task(health.watch(session, self.pool, spec=spec)),
                asyncio.create_task(monitor.watch(session, self.pool)),
                asyncio.create_task(worker.health.publish_forever(self.pool))]

    async def complete(self, scope: Scope, receive: Receive, send: Send) -> None:
        """POST /v1/completions and /v1/chat/completions, as plain ASGI: these routes carry every
        token, so they skip Starlette's middleware and its wrappers around each ``send``."""
        path, mode, status, call_id = scope["path"], None, 500, ""
        headers = header_map(scope)
        trace: tracing.RequestTrace = tracing.NO_TRACE
        try:
            call_id = request_id(headers.get(b"x-request-id"))
            authorization = headers.get(b"authorization")
            self.keys.require(authorization, Access.CLIENT)
            mode = requested_mode(headers.get(b"x-pd-mode"), access=self.keys.grant(authorization))
            trace = self._tracing.request(headers, request_id=call_id, path=path)
            async with self._admitted(path, headers, receive, call_id=call_id, mode=mode, trace=trace) as call:
                connection = offered(scope)
                with DisconnectGuard(receive, lost=connection.get("lost")):
                    async with self.admission.gateway_slot():  # held until the last byte, whatever ends it
                        reply = await self._run(call)
                        mode, status = reply.mode or mode, 200  # from here on, failures reach the client in the stream
                        try:
                            await send_reply(send, reply, request_id=call_id, transport=connection.get("transport"))
                        finally:
                            reply.close()
        except ClientDisconnected:
            if status != 200:
                status = 499  # gone before its reply started
        except Exception as exc:  # the last place a failure can still become an OpenAI error
            if status == 200:
                raise  # the reply has started: the server logs it and cuts the connection
            error = client_error(exc, request_id=call_id)
            status = error.status
            await send_error(send, error, request_id=call_id)
        finally:
            self.metrics.requests.labels(path, "auto" if mode is None else mode.value, str(status)).inc()
            trace.finish(status)

    @contextlib.asynccontextmanager
    async def _admitted(self, path: str, headers: dict[bytes, bytes], receive: Receive, *, call_id: str,
                        mode: Mode | None, trace: tracing.RequestTrace) -> AsyncIterator[Call]:
        """The request read and checked, counted against its key's limits for the block (gateway/key_limits.py),
        its body salted with its tenant's cache_salt (gateway/tenants.py). Raises BadRequest, RateLimited."""
        body = await self._read_request(path, headers, receive)
        tenant, key = self.keys.tenant(headers.get(b"authorization")), self.router.key(body)
        max_model_len = None if self._model_cards is None else self._model_cards.max_model_len
        tokens = requested_tokens(body, prompt_tokens=key.tokens, max_model_len=max_model_len)
        with self.key_limits.admit(tenant, tokens=tokens) as charge:
            if self.settings.access.cache_salt_per_key:  # the client's own salt parts its tenant's cache further
                body["cache_salt"] = self._salts.salt(tenant, chosen=body.get("cache_salt"))
            yield Call(path=path, body=body, mode=mode, request_id=call_id, arrived_s=time.perf_counter(),
                       trace=trace, prompt_key=key, on_usage=charge.settle if self.key_limits.meters_tokens else None)

    async def _read_request(self, path: str, headers: dict[bytes, bytes], receive: Receive) -> dict[str, Any]:
        """The validated JSON body; raises BadRequest (400, 404 for an unknown model, 413), before any engine sees
        it: for a structured-output schema too large to compile (gateway/schema_limits.py) or a media URL the
        engines may not fetch (gateway/media_urls.py) too."""
        spec = self.settings.gateway
        body = parse_json_object(await read_body(receive, headers, limit=spec.max_body_bytes))
        validate_request(body, SCHEMAS[path])
        if body["model"] != self.settings.model.served_name:
            raise BadRequest(f"The model `{body['model']}` does not exist.", status=404,
                             param="model", code="model_not_found")
        check_schemas(body, max_bytes=spec.max_schema_bytes, max_nodes=spec.max_schema_nodes)
        check_media_urls(body, domains=self.settings.access.media_url_domains)
        return body

    async def _run(self, call: Call) -> Reply:
        assert self._orchestrator is not None, "lifespan not started"
        return await self._orchestrator.run(call)

    async def models(self, request: Request) -> Response:
        """The served model as its engines list it (root, max_model_len, ...: gateway/model_card.py),
        once the gateway is ready (a client that polls this waits for warm-up too); the model's path on
        disk to the admin only."""
        self.keys.require(authorization(request), Access.CLIENT)
        if not self.readiness.report(self.pool)[0]:
            raise NotReady()
        assert self._model_cards is not None, "lifespan not started"
        card = await self._model_cards.card(self.pool)
        if self.keys.grant(authorization(request)) < Access.ADMIN:
            card = without_path(card)
        return Response(json.dumps({"object": "list", "data": [card]}), media_type=JSON)

    async def live(self, _request: Request) -> Response:
        """Liveness: the gateway's event loop answers. Engines play no part: restarting the
        gateway would not bring them back."""
        return Response(b'{"status": "alive"}', media_type=JSON)

    async def ready(self, _request: Request) -> Response:
        """Readiness: 200 once engines of both roles answer and a warm-up went through both legs."""
        is_ready, body = self.readiness.report(self.pool)
        return Response(json.dumps(body), status_code=200 if is_ready else 503, media_type=JSON)

    async def prometheus(self, request: Request) -> Response:
        """The gateway's metrics (every worker's, summed), for the admin only: they name the engines.
        A Prometheus scrape sends ``Authorization: Bearer <admin key>``."""
        self.keys.require(authorization(request), Access.ADMIN)
        body = self.metrics.render()
        if self._worker is not None:
            body = await self._worker.gather_metrics(body)  # every worker's, summed
        return Response(body, media_type="text/plain; version=0.0.4")


class GatewayApp:
    """The ASGI app: the two completion routes go straight to the gateway, the rest (models,
    health, metrics, the lifespan, 404/405) through Starlette. Oversized headers stop here."""

    def __init__(self, gateway: Gateway, rest: Starlette) -> None:
        self._gateway, self._rest = gateway, rest
        self._max_header_bytes = gateway.settings.gateway.max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                check_header_size(scope, limit=self._max_header_bytes)
            except BadRequest as exc:
                await send_error(send, client_error(exc, request_id=""), request_id="")
                return
        if scope["type"] != "http" or scope["path"] not in SCHEMAS:
            await self._rest(scope, receive, send)
        elif scope["method"] == "POST":
            await self._gateway.complete(scope, receive, send)
        else:
            body = error_body("Method Not Allowed", type_="invalid_request_error", code="method_not_allowed")
            await send_whole(send, 405, body, extra_headers=((b"allow", b"POST"),))


def build_app(settings: Settings, source: EndpointSource | None = None, *, worker: Worker | None = None,
              members: MembersFolder | None = None, span_exporter: SpanExporter | None = None,
              engine_key: EngineKey | None = None) -> GatewayApp:
    """The gateway as an ASGI app serving ``settings`` (engines must be started elsewhere).

    Its engines come from ``source``; by default those `pdserve up` publishes in ``members`` (which
    /admin/scale resizes), else the configured ones (launched elsewhere, or urls).
    ``worker``: this app is one of several processes on the port (gateway/workers.py).
    ``span_exporter``: where spans go (tests: the SDK's in-memory one) instead of gateway.otlp_traces_endpoint.
    ``engine_key``: what the engines require; None = the one given, or kept by a `pdserve up` (engine_key.py).
    Raises ConfigError for unreadable or malformed access or engine keys, unusable TLS files, or a gateway that would be
    open beyond loopback (gateway/exposure.py).
    """
    if source is None and members is not None:
        source = LaunchedEngines(members, external={role: settings.pool(role).urls for role in Role})
    kv_logs = {spec.base_url: settings.engine_log_dir / f"{spec.name}.log" for spec in settings.engine_specs()}
    gateway = Gateway(settings, source or FixedEndpoints(
        prefill_urls=settings.endpoint_urls(Role.PREFILL), decode_urls=settings.endpoint_urls(Role.DECODE),
        kv_logs=kv_logs),
        gateway_keys(settings, say_open=worker is None), worker=worker, members=members, span_exporter=span_exporter,
        engine_key=load_engine_key(settings.gateway, run_dir=settings.run_dir) if engine_key is None else engine_key)
    routes = [
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.admin.health, methods=["GET"]),
        Route("/health/live", gateway.live, methods=["GET"]),
        Route("/health/ready", gateway.ready, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
        Route("/admin/engines", gateway.admin.engines, methods=["GET"]),
        Route("/admin/scale", gateway.admin.scale, methods=["GET", "POST"]),
        Route(dashboard.PAGE_PATH, gateway.admin.dashboard_page, methods=["GET"]),
        Route(dashboard.STATE_PATH, gateway.admin.dashboard_state, methods=["GET"]),
    ]
    handlers = {HTTPException: _http_error, PdserveError: _pdserve_error, Exception: _pdserve_error}
    rest = Starlette(routes=routes, lifespan=gateway.lifespan, exception_handlers=handlers)
    return GatewayApp(gateway, rest)


async def _http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    return Response(error_body(exc.detail, type_="invalid_request_error", code=code),
                    status_code=exc.status_code, media_type=JSON, headers=exc.headers)


async def _pdserve_error(_request: Request, exc: Exception) -> Response:
    error = client_error(exc, request_id="")
    return Response(error.body(), status_code=error.status, media_type=JSON, headers=dict(error_headers(error)))
