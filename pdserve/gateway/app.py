"""The gateway's ASGI app: routes, lifespan (HTTP client, pool, health loop, warm-up), access checks.

Request shaping lives in pd/, the request flow in orchestrator.py, what a failure tells the client
in client_errors.py; this module only speaks HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypedDict, cast

import aiohttp
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdserve.access import Access, AccessKeys, load_access_keys
from pdserve.config import Settings
from pdserve.engines.members import MembersFolder
from pdserve.errors import BadRequest, NotReady, PdserveError
from pdserve.gateway import dashboard, readiness, tracing
from pdserve.gateway.admission import Admission
from pdserve.gateway.call import Call, Reply
from pdserve.gateway.client_errors import ClientError, client_error
from pdserve.gateway.disconnect import ClientDisconnected, DisconnectGuard
from pdserve.gateway.engine_rows import EngineRow, engine_rows, rows_json, with_leg_counts, workers_counted
from pdserve.gateway.handoffs import Handoffs
from pdserve.gateway.kv_monitor import KVMonitor
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.model_card import ModelCards
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.recent import RecentRequests
from pdserve.gateway.request_input import check_header_size, header_map, parse_mode, read_body, request_id
from pdserve.gateway.scaling import MAX_BODY_BYTES, wanted_pools
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

log = logging.getLogger(__name__)
JSON = "application/json"
# The scope extension under which gateway/server.py offers the client connection's transport.
TRANSPORT_EXTENSION = "pdserve.transport"
_TCP_CORK: int | None = getattr(socket, "TCP_CORK", None)
SCHEMAS: dict[str, type[ChatRequest | CompletionRequest]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
}


class Gateway:
    """State with a lifecycle: the upstream HTTP session, the endpoint pool, its health loop and warm-up."""

    def __init__(self, settings: Settings, source: EndpointSource, keys: AccessKeys, *,
                 worker: Worker | None = None, members: MembersFolder | None = None,
                 span_exporter: SpanExporter | None = None) -> None:
        self.settings, self.source, self.keys = settings, source, keys
        self._members = members  # the engines `pdserve up` launched (and scales), or None
        self._span_exporter, self._tracing = span_exporter, tracing.OFF  # started with the lifespan
        self._worker = worker  # one of several processes on the port (gateway/workers.py), or None
        self.pool = Pool()
        self.admission = Admission(self.pool, spec=settings.gateway)
        self.metrics = GatewayMetrics(self.pool, self.admission)
        self.readiness = readiness.Readiness()
        self.recent = RecentRequests()  # the live page's list, filled by the orchestrator
        # Each process's prefix index sees only its own requests: it keeps its share of each engine's cache.
        self.router = Router(settings.routing, gateway_processes=settings.gateway.workers if worker is not None else 1)
        self._orchestrator: Orchestrator | None = None
        self._model_cards: ModelCards | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        spec = self.settings.gateway
        # The legs get their own lean client (pd/engine_http.py); health probes and metrics
        # scrapes use aiohttp. No cookie jar: an engine's Set-Cookie must never ride along.
        client = EngineClient(connect_timeout_s=spec.connect_timeout_s, link_timeout_s=spec.link_timeout_s)
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
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
            self.authorize(headers.get(b"authorization"), Access.CLIENT)
            mode = parse_mode(headers.get(b"x-pd-mode"))
            trace = self._tracing.request(headers, request_id=call_id, path=path)
            call = Call(path=path, body=await self._read_request(path, headers, receive), mode=mode,
                        request_id=call_id, arrived_s=time.perf_counter(), trace=trace)
            connection = offered(scope)
            with DisconnectGuard(receive, lost=connection.get("lost")):
                async with self.admission.gateway_slot():  # held until the last byte, whatever ends it
                    reply = await self._run(call)
                    status = 200  # from here on, failures reach the client inside the stream
                    try:
                        await _send_reply(send, reply, request_id=call_id, transport=connection.get("transport"))
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
            await _send_error(send, error, request_id=call_id)
        finally:
            self.metrics.requests.labels(path, "auto" if mode is None else mode.value, str(status)).inc()
            trace.finish(status)

    def authorize(self, authorization: bytes | None, needed: Access) -> None:
        """Raises BadRequest (401) unless ``authorization`` grants ``needed``; the key is never echoed."""
        if self.keys.grant(authorization) < needed:
            message = "Incorrect API key provided." if authorization else (
                "You didn't provide an API key: send it as `Authorization: Bearer <key>`.")
            raise BadRequest(message, status=401, code="invalid_api_key")

    async def _read_request(self, path: str, headers: dict[bytes, bytes], receive: Receive) -> dict[str, Any]:
        """The validated JSON body; raises BadRequest (400, 404 for an unknown model, 413)."""
        body = parse_json_object(await read_body(receive, headers, limit=self.settings.gateway.max_body_bytes))
        validate_request(body, SCHEMAS[path])
        if body["model"] != self.settings.model.served_name:
            raise BadRequest(f"The model `{body['model']}` does not exist.", status=404,
                             param="model", code="model_not_found")
        return body

    async def _run(self, call: Call) -> Reply:
        assert self._orchestrator is not None, "lifespan not started"
        return await self._orchestrator.run(call)

    async def models(self, request: Request) -> Response:
        """The served model as its engines list it (root, max_model_len, ...: gateway/model_card.py),
        once the gateway is ready (a client that polls this waits for warm-up too)."""
        self.authorize(_authorization(request), Access.CLIENT)
        if not self.readiness.report(self.pool)[0]:
            raise NotReady()
        assert self._model_cards is not None, "lifespan not started"
        card = await self._model_cards.card(self.pool)
        return Response(json.dumps({"object": "list", "data": [card]}), media_type=JSON)

    async def health(self, request: Request) -> Response:
        """200 while at least one engine of each role answers its health probe. Lists every engine
        to the admin (to anyone when no key is configured): their addresses are internal."""
        counts = {role.value: len(self.pool.healthy(role)) for role in Role}
        is_ready = all(counts.values())
        body: dict[str, Any] = {"status": "ok" if is_ready else "degraded", "healthy_engines": counts}
        if self.keys.grant(_authorization(request)) >= Access.ADMIN:
            rows, counted = await self._engine_rows()
            in_flight = {(row.role, row.url): row.in_flight for row in rows}
            if self._worker is not None:  # in_flight is exact for the workers counted: say how many
                body["in_flight_counted"] = {"workers": counted, "of": self._worker.count}
            body["engines"] = {role.value: [
                {"url": endpoint.url, "is_healthy": endpoint.is_healthy,
                 "in_flight": in_flight.get((role, endpoint.url), endpoint.in_flight),
                 "kv_path": dataclasses.asdict(endpoint.kv_path)}
                for endpoint in self.pool.all(role)] for role in Role}
        return Response(json.dumps(body), status_code=200 if is_ready else 503, media_type=JSON)

    async def engines(self, request: Request) -> Response:
        """Every engine's health, load and legs, for the admin only (``pdserve status``)."""
        self.authorize(_authorization(request), Access.ADMIN)
        return Response(json.dumps(rows_json((await self._engine_rows())[0])), media_type=JSON)

    async def _engine_rows(self) -> tuple[list[EngineRow], int]:
        """One row per engine, with the legs of the whole gateway: each of gateway.workers counts
        only its own, and their /metrics, asked now and summed, count all; and how many workers
        answered (one that did not in 2 s is left out, gateway/workers.py)."""
        rows = engine_rows(self.pool, now_s=time.monotonic(), max_age_s=self.settings.routing.load_max_age_s)
        if self._worker is None:
            return rows, 1
        text = (await self._worker.gather_metrics(self.metrics.render())).decode()
        return with_leg_counts(rows, text), workers_counted(text)

    async def scale(self, request: Request) -> Response:
        """GET: the engines `pdserve up` launched, with their states; POST ``{"prefill": N, "decode": M}``:
        ask it for those pool sizes (202: added engines join once ready, removed ones drain first)."""
        self.authorize(_authorization(request), Access.ADMIN)
        members = self._members.read() if self._members is not None else None
        if self._members is None or members is None:
            raise BadRequest("this gateway's engines were not launched by `pdserve up`, so it cannot scale them "
                             "(on Ray, Serve's autoscaler sizes the pools: ray.autoscaling)", status=409,
                             code="scaling_unavailable")
        if request.method == "GET":
            return Response(json.dumps(members.to_json()), media_type=JSON)
        body = parse_json_object(await read_body(request.receive, header_map(request.scope), limit=MAX_BODY_BYTES))
        wanted = wanted_pools(body, current=members.wanted, settings=self.settings)
        self._members.request_scale(wanted)
        log.info("admin asked for %s", ", ".join(f"{role.value}={count}" for role, count in wanted.items()))
        reply = {**members.to_json(), "wanted": {role.value: count for role, count in wanted.items()}}
        return Response(json.dumps(reply), status_code=202, media_type=JSON)

    async def dashboard_page(self, request: Request) -> Response:
        """The live page (gateway/dashboard.py), for the admin only: it names engines."""
        if dashboard.grant(self.keys, _authorization(request)) < Access.ADMIN:
            return dashboard.ask_for_key()
        return dashboard.page()

    async def dashboard_state(self, request: Request) -> Response:
        """What the live page polls: engines, recent requests, latency and KV counters."""
        if dashboard.grant(self.keys, _authorization(request)) < Access.ADMIN:
            return dashboard.ask_for_key()
        rows = engine_rows(self.pool, now_s=time.monotonic(), max_age_s=self.settings.routing.load_max_age_s)
        rows, families = await dashboard.with_metrics(rows, self.metrics, self._worker)
        body = dashboard.state(rows, families, self.recent.latest(), worker=self._worker)
        return Response(json.dumps(body), media_type=JSON, headers={"cache-control": "no-store"})

    async def live(self, _request: Request) -> Response:
        """Liveness: the gateway's event loop answers. Engines play no part: restarting the
        gateway would not bring them back."""
        return Response(b'{"status": "alive"}', media_type=JSON)

    async def ready(self, _request: Request) -> Response:
        """Readiness: 200 once engines of both roles answer and a warm-up went through both legs."""
        is_ready, body = self.readiness.report(self.pool)
        return Response(json.dumps(body), status_code=200 if is_ready else 503, media_type=JSON)

    async def prometheus(self, _request: Request) -> Response:
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
                await _send_error(send, client_error(exc, request_id=""), request_id="")
                return
        if scope["type"] != "http" or scope["path"] not in SCHEMAS:
            await self._rest(scope, receive, send)
        elif scope["method"] == "POST":
            await self._gateway.complete(scope, receive, send)
        else:
            body = error_body("Method Not Allowed", type_="invalid_request_error", code="method_not_allowed")
            await _send_whole(send, 405, body, extra_headers=((b"allow", b"POST"),))


def build_app(settings: Settings, source: EndpointSource | None = None, *, worker: Worker | None = None,
              members: MembersFolder | None = None, span_exporter: SpanExporter | None = None) -> GatewayApp:
    """The gateway as an ASGI app serving ``settings`` (engines must be started elsewhere).

    Its engines come from ``source``; by default those `pdserve up` publishes in ``members`` (which
    /admin/scale resizes), else the configured ones (launched elsewhere, or urls).
    ``worker``: this app is one of several processes on the port (gateway/workers.py).
    ``span_exporter``: where spans go (tests: the SDK's in-memory one) instead of gateway.otlp_traces_endpoint.
    Raises ConfigError for unreadable or malformed access keys.
    """
    if source is None and members is not None:
        source = LaunchedEngines(members, external={role: settings.pool(role).urls for role in Role})
    kv_logs = {spec.base_url: settings.engine_log_dir / f"{spec.name}.log" for spec in settings.engine_specs()}
    gateway = Gateway(settings, source or FixedEndpoints(
        prefill_urls=settings.endpoint_urls(Role.PREFILL), decode_urls=settings.endpoint_urls(Role.DECODE),
        kv_logs=kv_logs),
        load_access_keys(settings.gateway), worker=worker, members=members, span_exporter=span_exporter)
    routes = [
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/health/live", gateway.live, methods=["GET"]),
        Route("/health/ready", gateway.ready, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
        Route("/admin/engines", gateway.engines, methods=["GET"]),
        Route("/admin/scale", gateway.scale, methods=["GET", "POST"]),
        Route(dashboard.PAGE_PATH, gateway.dashboard_page, methods=["GET"]),
        Route(dashboard.STATE_PATH, gateway.dashboard_state, methods=["GET"]),
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
    return Response(error.body(), status_code=error.status, media_type=JSON, headers=dict(_error_headers(error)))


def _authorization(request: Request) -> bytes | None:
    value = request.headers.get("authorization")
    return None if value is None else value.encode("latin-1")


def _error_headers(error: ClientError) -> list[tuple[str, str]]:
    """What tells a client how to come back: the auth scheme after a 401, a wait after a 429 or 503."""
    if error.status == 401:
        return [("www-authenticate", "Bearer")]
    if error.retry_after_s is not None:
        return [("retry-after", str(error.retry_after_s))]
    return []


async def _send_error(send: Send, error: ClientError, *, request_id: str) -> None:
    extra = [(name.encode(), value.encode()) for name, value in _error_headers(error)]
    if request_id:
        extra.append((b"x-request-id", request_id.encode()))
    await _send_whole(send, error.status, error.body(), extra_headers=tuple(extra))


class OfferedConnection(TypedDict, total=False):
    """What gateway/server.py offers of each request's client connection, under TRANSPORT_EXTENSION."""

    transport: asyncio.WriteTransport
    lost: asyncio.Future[None]  # done once the connection is lost


def offered(scope: Scope) -> OfferedConnection:
    """What the server offers of the client's connection; empty where it offers nothing."""
    return cast(OfferedConnection, scope.get("extensions", {}).get(TRANSPORT_EXTENSION, {}))


async def _send_reply(send: Send, reply: Reply, *, request_id: str, transport: asyncio.WriteTransport | None) -> None:
    """The decode engine's reply to the client: SSE bytes relayed as they come, or one JSON body.

    Where the server offers its ``transport``, a chunk is written to it at once while nothing waits
    in its buffer: the bytes uvicorn would write for it, from the engine socket's read, with no ASGI
    message and no task woken (docs/benchmarks.md, section 1). With bytes queued (a slow client) it
    goes through ``send``, which waits for the buffer to drain. A first chunk already in hand takes
    the response head along in one packet (``ClientTransport.hold``).
    """
    extra = ((b"x-request-id", request_id.encode()),)
    if reply.stream is None:
        assert reply.json_body is not None
        await _send_whole(send, 200, reply.json_body, extra_headers=extra)
        return
    message = {"type": "http.response.body", "body": b"", "more_body": True}  # one dict for every chunk
    client = None if transport is None else ClientTransport(transport)
    if client is not None and reply.first_chunk_ready:
        client.hold()
    try:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), *extra]})
        async for chunk in reply.stream(client):
            if client is None or not client.write_now(chunk):
                message["body"] = chunk
                await send(message)
            if client is not None:
                client.release()  # a held head has gone out with the first chunk
    finally:
        if client is not None:
            client.release()
    await send({"type": "http.response.body", "body": b""})


class ClientTransport:
    """The client connection's transport as the relay writes to it: chunks of the chunked body at
    once, unless bytes wait in its buffer (an empty chunk goes through ``send``: written here, it
    would read as the body's end)."""

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self._transport = transport
        self._buffered, self._is_closing, self._write = transport.get_write_buffer_size, transport.is_closing, transport.write
        self._is_tls = transport.get_extra_info("sslcontext") is not None  # its socket carries ciphertext only
        self._is_held = False

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

    def write_framed(self, data: bytes) -> None:
        if not self._is_closing():  # a client gone mid-write: nothing more reaches it
            self._write(data)

    @property
    def idle_fd(self) -> int | None:
        if self._buffered() or self._is_closing() or self._is_tls:
            return None
        return int(self._transport.get_extra_info("socket").fileno())


async def _send_whole(
    send: Send, status: int, body: bytes, *, extra_headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    headers = [(b"content-type", JSON.encode()), (b"content-length", b"%d" % len(body)), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
