"""Traces: the gateway's span tree for one request, and the W3C trace context its engines receive."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdserve.errors import ConfigError
from pdserve.gateway import tracing
from pdserve.gateway.app import build_app
from pdserve.role import Role
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, gateway_settings, post, ready_gateway_over, until_ready

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
STREAM = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}


@asynccontextmanager
async def traced_gateway(
    exporter: InMemorySpanExporter, *, prefill: Sequence[FakeEngine], decode: Sequence[FakeEngine]
) -> AsyncIterator[str]:
    """A ready gateway exporting its spans to ``exporter``, over these fake engines (their warm-up requests
    forgotten); yields its base URL. Leaving the block shuts the gateway down, which exports every span."""
    async with AsyncExitStack() as stack:
        urls = {id(fake): await stack.enter_async_context(serving(fake.app(), free_port()))
                for fake in {id(fake): fake for fake in [*prefill, *decode]}.values()}
        settings = gateway_settings(prefill=[urls[id(fake)] for fake in prefill],
                                    decode=[urls[id(fake)] for fake in decode])
        base = await stack.enter_async_context(serving(build_app(settings, span_exporter=exporter),
                                                       settings.gateway.port))
        await until_ready(base)
        for fake in [*prefill, *decode]:
            fake.bodies.clear()
            fake.headers.clear()
        yield base


def by_name(spans: Sequence[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def traceparent_ids(header: str) -> tuple[int, int]:
    """The trace id and parent span id a traceparent header carries."""
    _version, trace_id, span_id, _flags = header.split("-")
    return int(trace_id, 16), int(span_id, 16)


async def test_one_request_is_one_span_tree_that_both_engines_join() -> None:
    exporter, fake = InMemorySpanExporter(), FakeEngine()
    async with traced_gateway(exporter, prefill=[fake], decode=[fake]) as base:
        status, payload = await post(base, STREAM, headers={"traceparent": CLIENT_TRACEPARENT, "X-Request-Id": "t1"})
    assert status == 200 and payload.endswith(b"data: [DONE]\n\n")
    spans = by_name(exporter.get_finished_spans())  # the warm-ups are not traced
    assert sorted(spans) == ["decode leg", "kv handoff", "prefill leg", "request"]
    assert all(len(group) == 1 for group in spans.values())
    (request,), (prefill,), (handoff,), (decode,) = (spans[name] for name in
                                                     ("request", "prefill leg", "kv handoff", "decode leg"))
    assert request.context is not None and request.parent is not None
    assert (request.parent.trace_id, request.parent.span_id) == (int(CLIENT_TRACE_ID, 16), int(CLIENT_SPAN_ID, 16))
    assert request.kind is SpanKind.SERVER and request.attributes is not None
    assert request.attributes["pdserve.request_id"] == "t1" and request.attributes["http.response.status_code"] == 200
    for child in (prefill, handoff, decode):
        assert child.parent is not None and child.parent.span_id == request.context.span_id
        assert child.context is not None and child.context.trace_id == int(CLIENT_TRACE_ID, 16)
        assert child.status.status_code is StatusCode.UNSET
    assert prefill.attributes == {"pdserve.role": "prefill", "pdserve.endpoint": prefill.attributes["pdserve.endpoint"],
                                  "http.response.status_code": 200, "pdserve.prompt_tokens": 1, "pdserve.kv_blocks": 2}  # "hi"
    assert decode.attributes is not None and decode.attributes["http.response.status_code"] == 200
    assert prefill.end_time == handoff.start_time  # the handoff starts as the prefill leg ends
    assert handoff.end_time is not None and decode.end_time is not None and handoff.end_time <= decode.end_time
    # Each engine's request carries its own leg's span as parent, so vLLM's spans hang under that leg.
    prefill_headers, decode_headers = fake.headers
    assert prefill.context is not None and decode.context is not None
    assert traceparent_ids(prefill_headers["traceparent"]) == (int(CLIENT_TRACE_ID, 16), prefill.context.span_id)
    assert traceparent_ids(decode_headers["traceparent"]) == (int(CLIENT_TRACE_ID, 16), decode.context.span_id)


async def test_a_request_without_a_traceparent_starts_its_own_trace() -> None:
    exporter, fake = InMemorySpanExporter(), FakeEngine()
    async with traced_gateway(exporter, prefill=[fake], decode=[fake]) as base:
        status, _ = await post(base, {"model": MODEL, "prompt": "hi"})
    assert status == 200
    spans = by_name(exporter.get_finished_spans())
    (request,) = spans["request"]
    assert request.parent is None and request.context is not None
    assert {traceparent_ids(headers["traceparent"])[0] for headers in fake.headers} == {request.context.trace_id}


async def test_a_decode_leg_that_breaks_is_a_span_with_its_error_and_the_next_engine_another() -> None:
    exporter, prefill, decode = InMemorySpanExporter(), FakeEngine(), [FakeEngine(), FakeEngine()]
    async with traced_gateway(exporter, prefill=[prefill], decode=decode) as base:
        for fake in decode:
            fake.break_stream_after = 0  # after its headers, before any token
        status, payload = await post(base, STREAM)
    assert status == 200 and b"decode_stream_failed" in payload
    spans = by_name(exporter.get_finished_spans())
    (request,), (handoff,) = spans["request"], spans["kv handoff"]
    assert request.context is not None
    legs = spans["decode leg"]
    assert len(legs) == 2 and len({leg.attributes["pdserve.endpoint"] for leg in legs if leg.attributes}) == 2
    for leg in [*legs, handoff]:
        assert leg.parent is not None and leg.parent.span_id == request.context.span_id
        assert leg.status.status_code is StatusCode.ERROR
    assert all(any(event.name == "exception" for event in leg.events) for leg in legs)
    # The first engine got the KV handoff, the second the original request (it prefills it itself), in one trace.
    assert sorted("kv_transfer_params" in fake.bodies[0] for fake in decode) == [False, True]
    assert {traceparent_ids(fake.headers[0]["traceparent"])[0] for fake in decode} == {request.context.trace_id}


async def test_with_export_off_the_clients_trace_context_still_reaches_both_engines() -> None:
    fake = FakeEngine()
    async with ready_gateway_over(fake) as base:
        fake.bodies.clear()
        fake.headers.clear()
        context = {"traceparent": CLIENT_TRACEPARENT, "tracestate": "vendor=abc"}
        status, _ = await post(base, STREAM, headers=context)
        assert status == 200
        assert [(headers["traceparent"], headers["tracestate"]) for headers in fake.headers] == [
            (CLIENT_TRACEPARENT, "vendor=abc")] * 2
        fake.headers.clear()
        await post(base, STREAM)
        await post(base, STREAM, headers={"traceparent": "not-a-trace"})
        assert len(fake.headers) == 4 and not any("traceparent" in headers for headers in fake.headers)


def test_export_off_makes_no_object_per_request_without_a_client_traceparent() -> None:
    trace = tracing.OFF.request({b"x-request-id": b"r"}, request_id="r", path="/v1/completions")
    assert trace is tracing.NO_TRACE and trace.leg(Role.PREFILL, "http://p") is tracing.NO_TRACE
    assert tracing.NO_TRACE.headers is None


def test_only_a_well_formed_traceparent_is_taken_from_the_client() -> None:
    assert tracing.client_context({b"traceparent": CLIENT_TRACEPARENT.encode()}) == {"traceparent": CLIENT_TRACEPARENT}
    for bad in ("ff" + CLIENT_TRACEPARENT[2:], CLIENT_TRACEPARENT.upper(), CLIENT_TRACEPARENT + "-00", "00-1-2-01"):
        assert tracing.client_context({b"traceparent": bad.encode(), b"tracestate": b"a=b"}) is None
    assert tracing.client_context({b"tracestate": b"a=b"}) is None
    state = tracing.client_context({b"traceparent": CLIENT_TRACEPARENT.encode(), b"tracestate": b"a=\x01"})
    assert state == {"traceparent": CLIENT_TRACEPARENT}  # a control character: tracestate dropped, not the trace


def test_otlp_endpoint_is_a_typed_setting_checked_at_load() -> None:
    settings = gateway_settings(prefill=[], decode=[], otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")
    assert settings.gateway.otlp_traces_endpoint == "http://127.0.0.1:4318/v1/traces"
    assert gateway_settings(prefill=[], decode=[]).gateway.otlp_traces_endpoint == ""  # off
    with pytest.raises(ConfigError, match="gateway.otlp_traces_endpoint"):
        gateway_settings(prefill=[], decode=[], otlp_traces_endpoint="collector:4318")


async def test_the_configured_endpoint_receives_the_spans_over_otlp_http() -> None:
    received: list[bytes] = []

    async def collect(request: Request) -> Response:
        received.append(await request.body())
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")

    collector = Starlette(routes=[Route("/v1/traces", collect, methods=["POST"])])
    port = free_port()  # the gateway stops first, which flushes its exporter into the collector
    async with serving(collector, port), ready_gateway_over(
            FakeEngine(), otlp_traces_endpoint=f"http://127.0.0.1:{port}/v1/traces") as base:
        await post(base, STREAM, headers={"traceparent": CLIENT_TRACEPARENT})
    names = set()
    for payload in received:
        export = ExportTraceServiceRequest.FromString(payload)
        for resource_spans in export.resource_spans:
            assert {"service.name": "pdserve-gateway"}.items() <= {
                attribute.key: attribute.value.string_value for attribute in resource_spans.resource.attributes}.items()
            names |= {span.name for scope in resource_spans.scope_spans for span in scope.spans
                      if span.trace_id.hex() == CLIENT_TRACE_ID}
    assert names == {"request", "prefill leg", "kv handoff", "decode leg"}
