"""What a client sees of a failure names none of our engines or hosts and carries no trace; the
log keeps the detail under the same request id."""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest

from pdserve.gateway.app import build_app
from pdserve.gateway.orchestrator import Orchestrator
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, gateway_settings, until_ready


async def post(base: str, body: dict[str, object], request_id: str) -> tuple[int, bytes, str | None]:
    async with aiohttp.ClientSession() as session, session.post(
        base + "/v1/completions", json=body, headers={"X-Request-Id": request_id}
    ) as reply:
        return reply.status, await reply.read(), reply.headers.get("X-Request-Id")


async def test_an_engine_5xx_is_a_502_naming_the_role_and_request_not_the_engine(caplog: pytest.LogCaptureFixture) -> None:
    broken = FakeEngine(reject_status=500)
    async with serving(broken.app(), free_port()) as url:
        settings = gateway_settings(prefill=[url], decode=[url], leg_attempts=1, local_fallback=False)
        async with serving(build_app(settings), settings.gateway.port) as base:
            with caplog.at_level(logging.ERROR):
                status, payload, echoed = await post(base, {"model": MODEL, "prompt": "hi"}, "req-502")
    host = url.removeprefix("http://")
    error = json.loads(payload)["error"]
    assert status == 502 and error["code"] == "prefill_failed" and "req-502" in error["message"]
    assert host not in payload.decode() and echoed == "req-502"
    assert any("req-502" in record.getMessage() and host in record.getMessage() for record in caplog.records)


async def test_an_engine_4xx_message_is_relayed_with_the_engine_address_cut_out() -> None:
    fake = FakeEngine(reject_status=400)
    async with serving(fake.app(), free_port()) as url:
        fake.reject_message = f"cannot fetch {url}/v1/x from 127.0.0.1: prompt too long"
        settings = gateway_settings(prefill=[url], decode=[url])
        async with serving(build_app(settings), settings.gateway.port) as base:
            status, payload, _ = await post(base, {"model": MODEL, "prompt": "hi"}, "req-400")
    message = json.loads(payload)["error"]["message"]
    assert status == 400 and "prompt too long" in message and url.removeprefix("http://") not in message


async def test_a_broken_stream_ends_with_an_error_event_that_names_no_engine() -> None:
    fake = FakeEngine(break_stream_after=2)
    async with serving(fake.app(), free_port()) as url:
        settings = gateway_settings(prefill=[url], decode=[url])
        async with serving(build_app(settings), settings.gateway.port) as base:
            await until_ready(base)
            status, payload, _ = await post(base, {"model": MODEL, "prompt": "hi", "stream": True}, "req-sse")
    assert status == 200 and b"decode_stream_failed" in payload and b"req-sse" in payload
    assert url.removeprefix("http://").encode() not in payload and b"127.0.0.1" not in payload


async def test_an_unexpected_error_is_a_500_openai_error_without_its_trace(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def explode(_self: Orchestrator, _call: object) -> None:
        raise RuntimeError("secret detail at 10.1.2.3:8100")

    fake = FakeEngine()
    async with serving(fake.app(), free_port()) as url:
        settings = gateway_settings(prefill=[url], decode=[url])
        async with serving(build_app(settings), settings.gateway.port) as base:
            await until_ready(base)
            monkeypatch.setattr(Orchestrator, "run", explode)
            with caplog.at_level(logging.ERROR):
                status, payload, echoed = await post(base, {"model": MODEL, "prompt": "hi"}, "req-500")
            monkeypatch.undo()
            ok_status, _, _ = await post(base, {"model": MODEL, "prompt": "hi"}, "req-after")
    error = json.loads(payload)["error"]
    assert status == 500 and error["code"] == "internal_error" and "req-500" in error["message"]
    assert b"10.1.2.3" not in payload and b"Traceback" not in payload and echoed == "req-500"
    assert any("req-500" in record.getMessage() and record.exc_info for record in caplog.records)
    assert ok_status == 200
