"""Traces of requests: W3C trace context in from the client and out to both legs, and spans over OTLP.

Spans (one tree per request): request -> prefill leg, kv handoff (prefill done -> first token),
decode leg; each retried or moved leg is one more child with its error. With no OTLP endpoint it
makes no span and formats no header: a client's traceparent goes to the engines as it came.
Knows nothing of HTTP servers or of the request flow; orchestrator.py says when each leg runs.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve.errors import LegFailed, UpstreamRejected
from pdserve.pd.kv import KVTransferParams
from pdserve.role import Role

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
SERVICE_NAME = "pdserve-gateway"
# W3C Trace Context, version 00's layout; version ff is invalid. A malformed one is dropped, as the spec says.
_TRACEPARENT = re.compile(r"(?!ff)[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE = re.compile(r"[\x20-\x7e]{1,512}")
_NO_ERROR = contextlib.nullcontext()
_PROPAGATOR = TraceContextTextMapPropagator()


class LegTrace(Protocol):
    """One attempt at one leg, as the orchestrator sees it."""

    @property
    def headers(self) -> Mapping[str, str] | None:
        """The trace context headers for this leg's engine request, or None for none."""

    def attempt(self) -> contextlib.AbstractContextManager[None]:
        """Around the leg's request: an exception raised inside is recorded and ends the leg."""

    def prefilled(self, kv: KVTransferParams) -> None:
        """The prefill leg succeeded: records its KV, ends it and starts the KV handoff."""

    def failed(self, exc: Exception) -> None:
        """The decode leg's reply broke; what follows, if anything, is no KV handoff."""

    def end(self) -> None:
        """The leg is over (idempotent)."""


class RequestTrace(Protocol):
    """One client request's trace: hands out its legs, ends the KV handoff and itself."""

    def leg(self, role: Role, url: str) -> LegTrace: ...

    def first_token(self) -> None: ...

    def finish(self, status: int) -> None: ...


class PassThrough:
    """Tracing off: every leg carries the client's own trace context headers (None: none sent)."""

    __slots__ = ("headers",)

    def __init__(self, headers: Mapping[str, str] | None) -> None:
        self.headers = headers

    def leg(self, role: Role, url: str) -> PassThrough:
        return self

    def attempt(self) -> contextlib.AbstractContextManager[None]:
        return _NO_ERROR

    def prefilled(self, kv: KVTransferParams) -> None:
        pass

    def failed(self, exc: Exception) -> None:
        pass

    def end(self) -> None:
        pass

    def first_token(self) -> None:
        pass

    def finish(self, status: int) -> None:
        pass


NO_TRACE = PassThrough(None)


def client_context(headers: Mapping[bytes, bytes]) -> dict[str, str] | None:
    """The client's ``traceparent`` (and ``tracestate``) when well-formed, else None. Pure."""
    traceparent = headers.get(b"traceparent")
    if traceparent is None or not _TRACEPARENT.fullmatch(value := traceparent.decode("latin-1")):
        return None
    context = {TRACEPARENT: value}
    tracestate = headers.get(b"tracestate")
    if tracestate is not None and _TRACESTATE.fullmatch(state := tracestate.decode("latin-1")):
        context[TRACESTATE] = state
    return context


class Tracing:
    """The gateway's tracer, or none (off). Owned by the gateway's lifespan: ``shutdown`` flushes."""

    def __init__(self, provider: TracerProvider | None) -> None:
        self._provider = provider
        self._tracer = None if provider is None else provider.get_tracer("pdserve.gateway")

    def request(self, headers: Mapping[bytes, bytes], *, request_id: str, path: str) -> RequestTrace:
        """The trace of a request that arrived with ``headers`` (lower-case names, as ASGI gives them)."""
        context = client_context(headers)
        if self._tracer is None:
            return NO_TRACE if context is None else PassThrough(context)
        return _RequestSpans(self._tracer, context, request_id=request_id, path=path)

    def shutdown(self) -> None:
        """Export what is still queued, then stop (blocks up to the exporter's timeout)."""
        if self._provider is not None:
            self._provider.shutdown()


OFF = Tracing(None)


def start(endpoint: str, *, exporter: SpanExporter | None = None) -> Tracing:
    """Spans batched to ``exporter``, by default OTLP over HTTP/protobuf to ``endpoint`` (a full URL,
    e.g. http://collector:4318/v1/traces); OFF when neither is given. The SDK is imported only here."""
    if exporter is None and not endpoint:
        return OFF
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider)


class _RequestSpans:
    """Tracing on: the request's span, the KV handoff's while it runs, and a span per leg attempt."""

    def __init__(self, tracer: Tracer, client: Mapping[str, str] | None, *, request_id: str, path: str) -> None:
        parent = None if client is None else _PROPAGATOR.extract(client)
        self._tracer = tracer
        self.span = tracer.start_span("request", context=parent, kind=SpanKind.SERVER, attributes={
            "pdserve.request_id": request_id, "http.route": path})
        self.context: Context = set_span_in_context(self.span)
        self._handoff: Span | None = None

    def leg(self, role: Role, url: str) -> LegTrace:
        span = self._tracer.start_span(f"{role.value} leg", context=self.context, kind=SpanKind.CLIENT,
                                       attributes={"pdserve.role": role.value, "pdserve.endpoint": url})
        headers: dict[str, str] = {}
        _PROPAGATOR.inject(headers, context=set_span_in_context(span))
        return _LegSpan(self, span, headers)

    def start_handoff(self, start_ns: int) -> None:
        self._handoff = self._tracer.start_span("kv handoff", context=self.context, start_time=start_ns)

    def end_handoff(self, exc: Exception | None = None) -> None:
        if self._handoff is None:
            return
        if exc is not None:
            _record(self._handoff, exc)
        self._handoff.end()
        self._handoff = None

    def first_token(self) -> None:
        self.end_handoff()

    def finish(self, status: int) -> None:
        if self._handoff is not None and status != 200:
            self._handoff.set_status(Status(StatusCode.ERROR, f"the request ended with status {status} first"))
        self.end_handoff()
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR, f"status {status}"))
        self.span.end()


class _LegSpan:
    def __init__(self, request: _RequestSpans, span: Span, headers: Mapping[str, str]) -> None:
        self._request, self._span, self.headers = request, span, headers
        self._is_ended = False

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            _record(self._span, exc)
            self.end()
            raise
        self._span.set_attribute("http.response.status_code", 200)  # legs.post returns only a 200

    def prefilled(self, kv: KVTransferParams) -> None:
        self._span.set_attributes({"pdserve.prompt_tokens": kv.prompt_tokens, "pdserve.kv_blocks": kv.block_count})
        end_ns = time.time_ns()
        self._span.end(end_ns)
        self._is_ended = True
        self._request.start_handoff(end_ns)

    def failed(self, exc: Exception) -> None:
        _record(self._span, exc)
        self._request.end_handoff(exc)  # a decode engine that broke before its first token never took the KV

    def end(self) -> None:
        if not self._is_ended:
            self._is_ended = True
            self._span.end()


def _record(span: Span, exc: BaseException) -> None:
    """The exception on ``span``, with the engine's status where there was one."""
    if isinstance(exc, LegFailed | UpstreamRejected) and exc.status is not None:
        span.set_attribute("http.response.status_code", exc.status)
    if isinstance(exc, Exception):
        span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, str(exc) or type(exc).__name__))
