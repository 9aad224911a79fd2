"""Per-key limits (gateway/key_limits.py): requests in flight and tokens per minute, per tenant, with 429 and a
Retry-After that says when the tenant's own budget frees; unit tests on a fake clock, then over HTTP."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from pdserve.access import API_KEYS_ENV
from pdserve.access_config import AccessSpec
from pdserve.errors import RateLimited
from pdserve.gateway.key_limits import KeyLimits, requested_tokens
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, ready_gateway_over
from tests.gateway.test_auth import CLIENT_KEY, OTHER_CLIENT_KEY, bearer


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_a_tenant_past_its_requests_in_flight_waits_for_one_of_its_own_to_end() -> None:
    clock = Clock()
    limits = KeyLimits(AccessSpec(per_key_max_in_flight=2), clock=clock)
    with limits.admit("a", tokens=10), limits.admit("a", tokens=10):
        with pytest.raises(RateLimited) as refused, limits.admit("a", tokens=10):
            pass
        with limits.admit("b", tokens=10):  # another tenant's budget is its own
            pass
        clock.now_s += 7.2  # these two took 7.2 s
    assert refused.value.kind == "requests" and refused.value.retry_after_s == 1
    with limits.admit("a", tokens=10), limits.admit("a", tokens=10), pytest.raises(RateLimited) as refused, \
            limits.admit("a", tokens=10):
        pass
    assert refused.value.retry_after_s == 8  # its requests' mean time, rounded up


def test_the_token_bucket_refuses_until_its_refill_time_and_usage_corrects_the_estimate() -> None:
    clock = Clock()
    limits = KeyLimits(AccessSpec(per_key_tokens_per_min=600), clock=clock)  # 10 tokens a second
    with limits.admit("a", tokens=500) as charge:
        with pytest.raises(RateLimited) as refused, limits.admit("a", tokens=200):
            pass
        assert refused.value.kind == "tokens" and refused.value.retry_after_s == 10  # 100 short, at 10/s
        charge.settle({"prompt_tokens": 20, "completion_tokens": 80, "total_tokens": 100})
    with limits.admit("a", tokens=500):  # 400 of the estimate came back: 500 left
        pass
    with pytest.raises(RateLimited), limits.admit("a", tokens=1):
        pass
    clock.now_s += 0.1
    with limits.admit("a", tokens=1):
        pass


def test_a_request_larger_than_a_minutes_budget_waits_for_a_full_bucket() -> None:
    clock = Clock()
    limits = KeyLimits(AccessSpec(per_key_tokens_per_min=60), clock=clock)
    with limits.admit("a", tokens=30):
        pass
    with pytest.raises(RateLimited) as refused, limits.admit("a", tokens=1000):
        pass
    assert refused.value.retry_after_s == 30
    clock.now_s += 30
    with limits.admit("a", tokens=1000):
        pass  # the bucket goes 940 below empty: the tenant's next request waits for that too
    with pytest.raises(RateLimited) as refused, limits.admit("a", tokens=1):
        pass
    assert refused.value.retry_after_s == 941


def test_a_request_may_spend_its_prompt_and_its_max_tokens_or_the_context_left() -> None:
    assert requested_tokens({"max_tokens": 50}, prompt_tokens=10.5, max_model_len=2048) == 61
    assert requested_tokens({"max_tokens": 50, "max_completion_tokens": 20}, prompt_tokens=10, max_model_len=None) == 30
    assert requested_tokens({}, prompt_tokens=48, max_model_len=2048) == 2048
    assert requested_tokens({}, prompt_tokens=48, max_model_len=None) == 48


async def post(base: str, body: dict[str, Any], key: str | None = None, *,
               request_id: str | None = None) -> tuple[int, dict[str, Any], str | None]:
    headers = {**(bearer(key) if key else {}), **({"X-Request-Id": request_id} if request_id else {})}
    async with aiohttp.ClientSession() as session, session.post(base + "/v1/completions", json=body,
                                                                headers=headers) as reply:
        payload = await reply.read()
        return reply.status, json.loads(payload) if not body.get("stream") else {}, reply.headers.get("Retry-After")


async def reached_engine(fake: FakeEngine, request_id: str) -> None:
    """Once a leg of request ``request_id`` reached ``fake``: the request is in flight."""
    while not any(headers.get("x-request-id") == request_id for headers in fake.headers):
        await asyncio.sleep(0.01)


async def test_one_key_at_its_requests_in_flight_gets_429_while_another_key_is_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, f"{CLIENT_KEY},{OTHER_CLIENT_KEY}")
    fake = FakeEngine()
    async with ready_gateway_over(fake, access={"per_key_max_in_flight": 1}) as base:
        fake.decode_gate = asyncio.Event()  # every request now stays in flight until it is set
        held = asyncio.create_task(post(base, {"model": MODEL, "prompt": "hi"}, CLIENT_KEY, request_id="held"))
        try:
            await asyncio.wait_for(reached_engine(fake, "held"), 30.0)
            refused = post(base, {"model": MODEL, "prompt": "hi"}, CLIENT_KEY)
            status, body, retry_after = await asyncio.wait_for(refused, 30.0)  # not held: refused at once
            other = asyncio.create_task(post(base, {"model": MODEL, "prompt": "hi"}, OTHER_CLIENT_KEY,
                                             request_id="other"))
            await asyncio.wait_for(reached_engine(fake, "other"), 30.0)  # the other key is not held back
        finally:
            fake.decode_gate.set()  # a request still held would keep the servers from shutting down
        assert (await held)[0] == 200 and (await other)[0] == 200
    assert status == 429 and retry_after is not None and int(retry_after) >= 1
    assert body["error"]["type"] == "requests" and body["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize("stream", [False, True])
async def test_tokens_per_minute_are_settled_with_the_engines_usage_then_refused_with_the_refill_time(
        stream: bool) -> None:
    # With no keys every client is one tenant. 57 tokens a minute; "hi" and max_tokens 50 may spend 51; the fake
    # engine's usage says 6 (1 prompt word, 5 generated), so 45 come back after each request.
    async with ready_gateway_over(FakeEngine(), access={"per_key_tokens_per_min": 57}) as base:
        first = {"model": MODEL, "prompt": "hi", "max_tokens": 50}
        if stream:
            first |= {"stream": True, "stream_options": {"include_usage": True}}
        assert (await post(base, first))[0] == 200
        assert (await post(base, {"model": MODEL, "prompt": "hi", "max_tokens": 50}))[0] == 200  # 51 left, not 6
        status, body, retry_after = await post(base, {"model": MODEL, "prompt": "hi", "max_tokens": 50})
    assert status == 429 and body["error"]["type"] == "tokens" and body["error"]["code"] == "rate_limit_exceeded"
    assert retry_after is not None and 1 <= int(retry_after) <= 7  # 45 left of 51, at 0.95 tokens a second
