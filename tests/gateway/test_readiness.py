"""Ready means ready: engines of both roles up and a warm-up through both legs; liveness is not readiness."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp
import pytest

from pdserve.errors import EngineStartFailed, LegFailed, NoHealthyEndpoint, UpstreamRejected
from pdserve.gateway.app import build_app
from pdserve.gateway.call import Call, Reply
from pdserve.gateway.readiness import Readiness, WarmUp, keep_warm
from pdserve.pd.resume import CHAT_PATH, COMPLETIONS_PATH
from pdserve.role import Role
from pdserve.routing.decision import Mode
from pdserve.routing.pool import Endpoint, Pool
from pdserve.up import wait_ready
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, gateway_settings, ready_gateway_over, until_ready


async def get(base: str, path: str) -> tuple[int, dict[str, object], str | None]:
    async with aiohttp.ClientSession() as session, session.get(base + path) as reply:
        return reply.status, json.loads(await reply.read()), reply.headers.get("Retry-After")


async def test_without_engines_the_gateway_is_live_but_not_ready_and_lists_no_model() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    settings = gateway_settings(prefill=[dead], decode=[dead])
    async with serving(build_app(settings), settings.gateway.port) as base:
        await asyncio.sleep(0.3)  # a warm-up attempt and a health probe have run
        live, ready, models = await get(base, "/health/live"), await get(base, "/health/ready"), await get(base, "/v1/models")
    assert live[0] == 200
    assert ready[0] == 503 and ready[1]["status"] == "not_ready" and ready[1]["warm_up"] in ("pending", "failed")
    assert dead.removeprefix("http://") not in json.dumps(ready[1])
    error = models[1]["error"]
    assert models[0] == 503 and isinstance(error, dict) and error["code"] == "not_ready" and models[2] == "1"


async def test_ready_after_the_gateways_own_warm_up_went_through_both_legs() -> None:
    fake = FakeEngine()
    async with ready_gateway_over(fake) as base:
        status, body, _ = await get(base, "/health/ready")
        models_status, _, _ = await get(base, "/v1/models")
    assert status == 200 and body["warm_up"] == "done" and models_status == 200
    prefill, decode = fake.bodies[:2]  # the warm-up: a prefill leg, then a decode leg with its KV params
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True and "remote_block_ids" in decode["kv_transfer_params"]


async def test_every_pair_has_had_a_chat_before_ready() -> None:
    """Two prefill and two decode engines: each of the four pairs has had a chat through both legs before the gateway
    is ready, not only the pair the gateway's first warm-up went through (a cold prefill engine's first chats waited
    1.4-2.2 s on a GPU)."""
    prefill, decode = [FakeEngine(), FakeEngine()], [FakeEngine(), FakeEngine()]
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serving(fake.app(), free_port())) for fake in prefill + decode]
        settings = gateway_settings(prefill=urls[:2], decode=urls[2:])
        base = await stack.enter_async_context(serving(build_app(settings), settings.gateway.port))
        await until_ready(base)

    def chats(fake: FakeEngine) -> set[str]:
        """The request ids of the warm-up chats ``fake`` served a leg of."""
        return {headers["x-request-id"] for body, headers in zip(fake.bodies, fake.headers, strict=True)
                if "messages" in body and headers["x-request-id"].startswith("warm-up-chat-")}

    pairs = [(p, d) for p in range(2) for d in range(2) for request_id in chats(prefill[p]) & chats(decode[d])]
    assert sorted(pairs) == [(0, 0), (0, 1), (1, 0), (1, 1)]


async def test_wait_ready_fails_fast_when_the_warm_up_fails_and_says_why_without_the_engine() -> None:
    broken = FakeEngine(reject_status=500)
    async with serving(broken.app(), free_port()) as url:
        settings = gateway_settings(prefill=[url], decode=[url], leg_attempts=1)
        async with serving(build_app(settings), settings.gateway.port) as base, aiohttp.ClientSession() as session:
            with pytest.raises(EngineStartFailed, match="prefill engine failed") as caught:
                await wait_ready(session, base, lambda _line: None, timeout_s=10)
    assert url.removeprefix("http://") not in str(caught.value)


class FakeOrchestrator:
    """Fails while ``is_failing``; counts warm-ups, the pairs they were held to, and the failed legs it is told of."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.is_failing = False
        self.chat_error: Exception | None = None  # what a chat gets instead of its reply
        self.failed_urls: list[str] = []
        self.pinned: list[tuple[str, str]] = []

    def on_pair(self, *, prefill_url: str, decode_url: str) -> FakeOrchestrator:
        self.pinned.append((prefill_url, decode_url))
        return self

    def leg_failed(self, endpoint: Endpoint, _request_id: str, _exc: Exception, *, is_unreachable: bool) -> None:
        assert not is_unreachable
        self.failed_urls.append(endpoint.url)

    async def run(self, call: Call) -> Reply:
        self.calls.append(call)
        if self.is_failing:
            raise NoHealthyEndpoint(Role.DECODE)
        if call.path == CHAT_PATH and self.chat_error is not None:
            raise self.chat_error
        return Reply(json_body=b"{}")


class FakePairs:
    """Warms pairs as told: records each, fails those in ``failing``."""

    def __init__(self) -> None:
        self.warmed: list[tuple[str, str]] = []
        self.failing: set[tuple[str, str]] = set()

    async def __call__(self, pair: tuple[str, str], body: dict[str, object], request_id: str) -> None:
        assert body["model"] == MODEL and request_id.startswith("warm-up-pair-")
        self.warmed.append(pair)
        if pair in self.failing:
            raise LegFailed(Role.DECODE, pair[1], 500, "KV handshake failed")


def keep_warm_task(pool: Pool, readiness: Readiness, orchestrator: FakeOrchestrator, pairs: FakePairs) -> asyncio.Task[None]:
    return asyncio.create_task(keep_warm(orchestrator, pool, readiness, warm_pair=pairs, model=MODEL,  # type: ignore[arg-type]
                                         interval_s=0.01))


async def test_every_pair_is_warmed_before_ready_and_one_added_later_without_losing_ready() -> None:
    pool, readiness, pairs = Pool(prefill_urls=["http://p"], decode_urls=["http://d0", "http://d1"]), Readiness(), FakePairs()
    pairs.failing = {("http://p", "http://d1")}
    orchestrator = FakeOrchestrator()
    task = keep_warm_task(pool, readiness, orchestrator, pairs)
    try:
        await asyncio.sleep(0.05)
        is_ready, body = readiness.report(pool)
        # a broken engine among several holds nobody up: tried, counted as a failed leg, tried again
        assert is_ready and body["warm_pairs"] == "1/2" and "the decode engine failed" in body["warm_up_error"]
        assert orchestrator.failed_urls and set(orchestrator.failed_urls) == {"http://d1"}
        pairs.failing.clear()
        await asyncio.sleep(0.05)
        assert readiness.report(pool) == (True, {"status": "ready", "healthy_engines": {"prefill": 1, "decode": 2},
                                                 "warm_up": "done", "warm_pairs": "2/2"})
        pool.set_urls(Role.DECODE, ["http://d0", "http://d1", "http://d2"])  # an engine added
        await asyncio.sleep(0.05)
        assert readiness.report(pool)[0] and ("http://p", "http://d2") in pairs.warmed
        # a warm pair is not warmed again; the one that failed was, at each look until it went through
        assert pairs.warmed.count(("http://p", "http://d0")) == pairs.warmed.count(("http://p", "http://d2")) == 1
        assert pairs.warmed.count(("http://p", "http://d1")) > 1
        # and each had one chat, once it went through
        assert sorted(orchestrator.pinned) == [("http://p", f"http://d{index}") for index in range(3)]
    finally:
        task.cancel()


async def test_a_role_losing_every_engine_makes_it_not_ready_until_a_new_warm_up_succeeds() -> None:
    pool, readiness, orchestrator = Pool(prefill_urls=["http://p"], decode_urls=["http://d"]), Readiness(), FakeOrchestrator()
    task = keep_warm_task(pool, readiness, orchestrator, FakePairs())
    try:
        await asyncio.sleep(0.05)
        assert readiness.report(pool)[0] and len(orchestrator.calls) == 2  # warm once, not on every tick
        call, chat = orchestrator.calls
        assert call.mode is Mode.PD and call.body["model"] == MODEL and call.request_id.startswith("warm-up-")
        assert chat.path == CHAT_PATH and chat.mode is Mode.PD and chat.is_stream and chat.body["model"] == MODEL
        assert orchestrator.pinned == [("http://p", "http://d")]  # the chat went through the pair
        pool.all(Role.DECODE)[0].is_healthy = False
        orchestrator.is_failing = True
        await asyncio.sleep(0.05)
        assert not readiness.report(pool)[0] and readiness.warm_up is WarmUp.PENDING
        pool.all(Role.DECODE)[0].is_healthy = True
        await asyncio.sleep(0.05)
        is_ready, body = readiness.report(pool)
        assert not is_ready and body["warm_up"] == "failed" and body["warm_up_error"] == "no healthy decode engine"
        orchestrator.is_failing = False
        await asyncio.sleep(0.05)
        assert readiness.report(pool)[0]
    finally:
        task.cancel()


@pytest.mark.parametrize("chat_error", [
    UpstreamRejected(Role.PREFILL, "http://p", 400, b'{"error": {"message": "this model has no chat template"}}'),
    LegFailed(Role.DECODE, "http://d", 500, "chat broke"),
])
async def test_a_chat_warm_up_that_fails_holds_nobody_up(chat_error: Exception, caplog: pytest.LogCaptureFixture) -> None:
    """A model without a chat template refuses every chat (clients' too); the completion proved both legs."""
    pool, readiness, orchestrator = Pool(prefill_urls=["http://p"], decode_urls=["http://d"]), Readiness(), FakeOrchestrator()
    orchestrator.chat_error = chat_error
    caplog.set_level(logging.INFO, logger="pdserve.gateway.readiness")
    task = keep_warm_task(pool, readiness, orchestrator, FakePairs())
    try:
        for _ in range(6000):  # up to a minute on a loaded machine; done in milliseconds
            if readiness.warm_up is WarmUp.DONE:
                break
            await asyncio.sleep(0.01)
        assert readiness.report(pool)[0] and [call.path for call in orchestrator.calls] == [COMPLETIONS_PATH, CHAT_PATH]
        assert "no chat template" in caplog.text if isinstance(chat_error, UpstreamRejected) else "chat broke" in caplog.text
    finally:
        task.cancel()
