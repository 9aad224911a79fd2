"""The gateway over real HTTP against fake engines: both legs, passthrough, errors, faults."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from pdserve.config import parse_settings
from pdserve.gateway.app import build_app
from tests.conftest import free_port, metric, serving
from tests.fake_engine import KV_PARAMS, WORDS, FakeEngine

MODEL = "pdserve-demo"


def gateway_settings(*, prefill: list[str], decode: list[str], decode_pool: dict[str, Any] | None = None,
                     access: dict[str, Any] | None = None, **gateway: Any) -> Any:
    """``decode_pool``: more of the decode pool's settings; ``access``: the access section's."""
    tree = {
        "prefill": {"engines": 0, "base_port": 1, "urls": prefill},
        "decode": {"engines": 0, "base_port": 2, "urls": decode, **(decode_pool or {})},
        "gateway": {"port": free_port(), "health_interval_s": 0.2, **gateway},
        "access": access or {},
        "cache_dir": "/tmp",
    }
    return parse_settings(tree, source="test")


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    async with serving(fake.app(), free_port()) as url:
        yield fake, url


async def until_ready(base: str, *, timeout_s: float = 5.0) -> None:
    """Wait for /health/ready: the gateway's own warm-up request has gone through both legs."""
    async with aiohttp.ClientSession() as session:
        for _ in range(int(timeout_s / 0.02)):
            async with session.get(base + "/health/ready") as reply:
                if reply.status == 200:
                    return
            await asyncio.sleep(0.02)
    raise AssertionError(f"{base} never became ready")


@asynccontextmanager
async def ready_gateway_over(fake: FakeEngine, **gateway: Any) -> AsyncIterator[str]:
    """The gateway over HTTP with ``fake`` as its prefill and decode engine, once ready; yields its base URL."""
    async with serving(fake.app(), free_port()) as url:
        settings = gateway_settings(prefill=[url], decode=[url], **gateway)
        async with serving(build_app(settings), settings.gateway.port) as base:
            await until_ready(base)
            yield base


@pytest.fixture
async def gateway(engine: tuple[FakeEngine, str]) -> AsyncIterator[str]:
    fake, url = engine
    settings = gateway_settings(prefill=[url], decode=[url], max_body_bytes=10_000)
    async with serving(build_app(settings), settings.gateway.port) as base:
        await until_ready(base)
        fake.bodies.clear()  # the warm-up's
        yield base


async def post(base: str, body: Any, *, headers: dict[str, str] | None = None, path: str = "/v1/completions") -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session, session.post(base + path, data=data, headers=headers) as reply:
        return reply.status, await reply.read()


async def test_pd_request_runs_prefill_then_decode_with_kv_params(gateway: str, engine: tuple[FakeEngine, str]) -> None:
    fake, _ = engine
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    status, payload = await post(gateway, body)
    assert status == 200
    prefill_body, decode_body = fake.bodies
    assert prefill_body["max_tokens"] == 1 and prefill_body["stream"] is False
    assert "stream_options" not in prefill_body
    assert prefill_body["kv_transfer_params"]["do_remote_decode"] is True
    assert decode_body["kv_transfer_params"] == {**KV_PARAMS, "remote_num_tokens": 1}  # as the prefill reply had them
    assert decode_body["max_tokens"] == 5 and decode_body["stream"] is True
    events = [json.loads(line[6:]) for line in payload.decode().split("\n\n") if line.startswith("data: {")]
    texts = [event["choices"][0]["text"] for event in events if event["choices"]]
    assert texts == WORDS and payload.endswith(b"data: [DONE]\n\n")
    assert events[-1]["usage"]["prompt_tokens"] == 1  # the decode engine's usage event, relayed


async def test_local_mode_sends_whole_request_to_decode_engine(gateway: str, engine: tuple[FakeEngine, str]) -> None:
    fake, _ = engine
    status, payload = await post(gateway, {"model": MODEL, "prompt": "hi"}, headers={"X-PD-Mode": "local"})
    assert status == 200 and json.loads(payload)["choices"][0]["text"] == "".join(WORDS)
    assert len(fake.bodies) == 1 and "kv_transfer_params" not in fake.bodies[0]


async def test_request_id_ties_legs_and_response(gateway: str) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(gateway + "/v1/chat/completions", json=body, headers={"X-Request-Id": "abc123"}) as reply:
            assert reply.status == 200
            assert reply.headers["X-Request-Id"] == "abc123"


BAD_INPUTS = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "best_of"),
    ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": MODEL, "prompt": "x" * 20_000}, 413, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_INPUTS)
async def test_bad_input_gets_openai_error_and_gateway_keeps_serving(gateway: str, body: Any, status: int, param: str | None) -> None:
    got_status, payload = await post(gateway, body)
    assert got_status == status
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param:
        assert error["param"] == param
    ok_status, _ = await post(gateway, {"model": MODEL, "prompt": "still there?"})
    assert ok_status == 200


async def test_bad_chat_messages_and_mode_header_are_rejected(gateway: str) -> None:
    status, payload = await post(gateway, {"model": MODEL, "messages": []}, path="/v1/chat/completions")
    assert status == 400 and json.loads(payload)["error"]["param"] == "messages"
    status, payload = await post(gateway, {"model": MODEL, "prompt": "hi"}, headers={"X-PD-Mode": "fast"})
    assert status == 400 and json.loads(payload)["error"]["param"] == "X-PD-Mode"


async def test_a_request_id_that_could_not_go_into_an_engine_header_is_rejected(gateway: str, engine: tuple[FakeEngine, str]) -> None:
    status, payload = await post(gateway, {"model": MODEL, "prompt": "hi"}, headers={"X-Request-Id": "has space"})
    assert status == 400 and json.loads(payload)["error"]["param"] == "X-Request-Id"
    assert engine[0].bodies == []


async def test_unknown_route_is_openai_404_and_a_get_on_completions_is_405(gateway: str) -> None:
    status, payload = await post(gateway, {}, path="/v1/embeddings")
    assert status == 404 and json.loads(payload)["error"]["code"] == "not_found"
    async with aiohttp.ClientSession() as session, session.get(gateway + "/v1/completions") as reply:
        assert reply.status == 405 and reply.headers["Allow"] == "POST"
        assert (await reply.json())["error"]["code"] == "method_not_allowed"


async def test_engine_4xx_is_relayed_with_its_status(gateway: str, engine: tuple[FakeEngine, str]) -> None:
    fake, _ = engine
    fake.reject_status = 400
    status, payload = await post(gateway, {"model": MODEL, "prompt": "very long"})
    assert status == 400 and json.loads(payload)["error"]["message"] == "prompt too long"
    assert len(fake.bodies) == 1  # rejected at prefill: no decode leg


async def test_prefill_5xx_fails_over_to_the_other_engine(engine: tuple[FakeEngine, str]) -> None:
    _fake, url = engine
    broken = FakeEngine(reject_status=500)
    async with serving(broken.app(), free_port()) as broken_url:
        settings = gateway_settings(prefill=[broken_url, url], decode=[url])
        async with serving(build_app(settings), settings.gateway.port) as base:
            for _ in range(4):
                status, _ = await post(base, {"model": MODEL, "prompt": "hi"})
                assert status == 200
            async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as reply:
                metrics = await reply.text()
    assert broken.bodies, "the broken engine was never tried"
    # every leg sent it failed and was counted, its pair's warm-up included
    assert f'pdserve_leg_failures_total{{role="prefill"}} {len(broken.bodies)}.0' in metrics


async def test_no_healthy_engine_is_503_and_health_says_so() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    settings = gateway_settings(prefill=[dead], decode=[dead])
    async with serving(build_app(settings), settings.gateway.port) as base:
        await asyncio.sleep(0.5)  # a health probe has run
        status, payload = await post(base, {"model": MODEL, "prompt": "hi"})
        assert status == 503 and json.loads(payload)["error"]["code"] == "no_healthy_engine"
        async with aiohttp.ClientSession() as session, session.get(base + "/health") as reply:
            assert reply.status == 503


async def test_stream_broken_midway_ends_with_one_error_event(gateway: str, engine: tuple[FakeEngine, str]) -> None:
    fake, _ = engine
    fake.break_stream_after = 2
    status, payload = await post(gateway, {"model": MODEL, "prompt": "hi", "stream": True})
    assert status == 200
    events = [event for event in payload.decode().split("\n\n") if event]
    assert json.loads(events[-2][6:])["error"]["code"] == "decode_stream_failed"
    assert events[-1] == "data: [DONE]"


async def test_client_disconnect_aborts_decode_stream(gateway: str, engine: tuple[FakeEngine, str]) -> None:
    fake, _ = engine
    fake.token_delay_s = 0.3
    async with aiohttp.ClientSession() as session:
        reply = await session.post(gateway + "/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
        await reply.content.readany()
        reply.close()
    assert await fake.closed_early_within() == 1


async def test_metrics_count_requests_ttft_and_tokens(gateway: str, engine: tuple[FakeEngine, str]) -> None:
    engine[0].token_delay_s = 0.02  # one chunk per token
    async with aiohttp.ClientSession() as session, session.get(gateway + "/metrics") as reply:
        before = await reply.text()  # the gateway's warm-ups are counted too
    await post(gateway, {"model": MODEL, "prompt": "hi", "stream": True})
    await post(gateway, {"model": "nope", "prompt": "hi"})
    async with aiohttp.ClientSession() as session, session.get(gateway + "/metrics") as reply:
        metrics = await reply.text()
    # Counted under the mode that served it; "auto" only where none did (refused before routing).
    assert 'pdserve_requests_total{mode="pd",route="/v1/completions",status="200"} 1.0' in metrics
    assert 'pdserve_requests_total{mode="auto",route="/v1/completions",status="404"} 1.0' in metrics

    def added(series: str) -> float:
        return metric(metrics, series) - metric(before, series)
    assert added('pdserve_time_to_first_token_seconds_count{mode="pd"}') == 1
    # A gap per token after the first; the end marker is no token.
    assert added('pdserve_inter_token_latency_seconds_count{mode="pd"}') == len(WORDS) - 1
    assert added("pdserve_kv_handoff_seconds_count") == 1


async def test_models_lists_served_model(gateway: str) -> None:
    async with aiohttp.ClientSession() as session, session.get(gateway + "/v1/models") as reply:
        models = await reply.json()
    assert [card["id"] for card in models["data"]] == [MODEL]
