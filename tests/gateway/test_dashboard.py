"""The live page's data and guard, over real HTTP against a fake engine (the page itself runs in
a browser in test_dashboard_page.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from pdserve.access import ADMIN_KEY_ENV, API_KEYS_ENV, Access, AccessKeys
from pdserve.gateway import dashboard
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.recent import FinishedRequest, RecentRequests, status_of
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, post, ready_gateway_over
from tests.gateway.test_kv_monitor import vllm_metrics

ADMIN_KEY, CLIENT_KEY = "sk-admin-0123456789abcdef", "sk-client-0123456789abcdef"


def basic(password: str, user: str = "admin") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


async def get(base: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    async with aiohttp.ClientSession() as session, session.get(base + path, headers=headers) as reply:
        return reply.status, await reply.read(), reply.headers


def finished(request_id: str) -> FinishedRequest:
    return FinishedRequest(request_id=request_id, mode="pd", prefill_url=None, decode_url="http://d", ttft_s=0.1,
                           handoff_s=None, e2e_s=0.2, chunks=3, kv=None, status="ok", finished_unix_s=0.0)


def test_recent_requests_keep_the_last_ones_newest_first() -> None:
    recent = RecentRequests(size=3)
    for index in range(5):
        recent.add(finished(str(index)))
    assert [request.request_id for request in recent.latest()] == ["4", "3", "2"]


def test_status_names_how_a_request_ended() -> None:
    assert status_of(is_stream=True, error_code=None, has_first_token=True, has_end_marker=True) == "ok"
    assert status_of(is_stream=True, error_code=None, has_first_token=True, has_end_marker=False) == "cut"
    assert status_of(is_stream=True, error_code="request_timeout", has_first_token=True,
                     has_end_marker=True) == "request_timeout"
    assert status_of(is_stream=False, error_code=None, has_first_token=False, has_end_marker=False) == "failed"


def test_histogram_sums_the_modes_buckets() -> None:
    metrics = GatewayMetrics()
    metrics.modes["pd"].ttft.observe(0.02)
    metrics.modes["local"].ttft.observe(0.3)
    metrics.modes["pd"].itl.observe(0.004)
    samples = list(dashboard.samples_of(metrics.registry.collect()))
    ttft = dashboard.histogram(samples, "pdserve_time_to_first_token_seconds")
    assert ttft["count"] == 2 and ttft["sum_s"] == pytest.approx(0.32)
    assert ttft["cumulative"][ttft["bounds_s"].index(0.025)] == 1 and ttft["cumulative"][-1] == 2
    assert dashboard.histogram(samples, "pdserve_inter_token_latency_seconds")["count"] == 1


def test_the_admin_key_works_as_a_bearer_token_or_a_basic_password() -> None:
    keys = AccessKeys(api_keys=(CLIENT_KEY.encode(),), admin_key=ADMIN_KEY.encode())
    assert dashboard.grant(keys, f"Bearer {ADMIN_KEY}".encode()) is Access.ADMIN
    assert dashboard.grant(keys, basic(ADMIN_KEY)["Authorization"].encode()) is Access.ADMIN
    assert dashboard.grant(keys, basic(ADMIN_KEY, user="")["Authorization"].encode()) is Access.ADMIN
    assert dashboard.grant(keys, basic(CLIENT_KEY)["Authorization"].encode()) is Access.CLIENT
    assert dashboard.grant(keys, b"Basic %%%not-base64") is Access.NONE
    assert dashboard.grant(keys, None) is Access.NONE
    assert dashboard.grant(AccessKeys(), None) is Access.ADMIN  # no keys configured: open


@pytest.mark.parametrize("path", [dashboard.PAGE_PATH, dashboard.STATE_PATH])
async def test_the_page_and_its_state_are_the_admins(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)
    monkeypatch.setenv(API_KEYS_ENV, CLIENT_KEY)
    async with ready_gateway_over(FakeEngine()) as base:
        for headers in (None, basic(CLIENT_KEY), {"Authorization": f"Bearer {CLIENT_KEY}"}, basic("x" * 20)):
            status, body, reply_headers = await get(base, path, headers)
            assert status == 401 and reply_headers["WWW-Authenticate"].startswith("Basic ")
            assert ADMIN_KEY.encode() not in body and CLIENT_KEY.encode() not in body
        for headers in (basic(ADMIN_KEY), {"Authorization": f"Bearer {ADMIN_KEY}"}):
            status, _, _ = await get(base, path, headers)
            assert status == 200


async def test_the_page_is_one_file_that_loads_nothing_from_elsewhere() -> None:
    async with ready_gateway_over(FakeEngine()) as base:
        status, body, headers = await get(base, dashboard.PAGE_PATH)
    html = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert not re.findall(r"""(?:src|href)\s*=\s*["'](?!data:)""", html), "the page links an asset"
    assert "__STATE_PATH__" not in html and "__POLL_MS__" not in html


async def test_state_lists_engines_and_each_finished_request_with_its_legs() -> None:
    fake = FakeEngine()
    async with ready_gateway_over(fake) as base:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}
        assert (await post(base, body, headers={"X-Request-Id": "pd-stream"}))[0] == 200
        assert (await post(base, {"model": MODEL, "prompt": "hi"},
                           headers={"X-Request-Id": "local-whole", "X-PD-Mode": "local"}))[0] == 200
        fake.break_stream_after = 2
        await post(base, body, headers={"X-Request-Id": "broken", "X-PD-Mode": "local"})
        status, payload, _ = await get(base, dashboard.STATE_PATH)
    state = json.loads(payload)
    url = state["engines"][0]["url"]
    assert status == 200 and [engine["role"] for engine in state["engines"]] == ["prefill", "decode"]
    requests = {request["request_id"]: request for request in state["requests"]}
    assert list(requests)[:3] == ["broken", "local-whole", "pd-stream"]  # newest first
    pd = requests["pd-stream"]
    assert pd["mode"] == "pd" and pd["prefill_url"] == url and pd["decode_url"] == url
    assert pd["status"] == "ok" and pd["chunks"] > 0 and 0 < pd["ttft_s"] <= pd["e2e_s"] and pd["handoff_s"] > 0
    local = requests["local-whole"]
    assert local["mode"] == "local" and local["prefill_url"] is None and local["handoff_s"] is None
    assert local["status"] == "ok" and local["ttft_s"] is not None
    assert requests["broken"]["status"] == "decode_stream_failed"
    assert state["ttft"]["count"] >= 2 and state["itl"]["count"] > 0 and state["gateway"]["answered"] >= 3


async def state_when(base: str, condition: Callable[[dict[str, Any]], bool], *, timeout_s: float = 20.0) -> dict[str, Any]:
    """The page's state once ``condition`` holds (polled, as the page does)."""
    deadline_s = asyncio.get_running_loop().time() + timeout_s
    while True:
        state: dict[str, Any] = json.loads((await get(base, dashboard.STATE_PATH))[1])
        if condition(state) or asyncio.get_running_loop().time() > deadline_s:
            return state
        await asyncio.sleep(0.1)


def decode_row(state: dict[str, Any]) -> dict[str, Any]:
    return next(engine for engine in state["engines"] if engine["role"] == "decode")


async def test_the_pages_kv_alarm_is_the_gateways_own_verdict_not_a_low_rate() -> None:
    """A healthy demo's small transfers (0.1 MB in 4 ms: 0.025 GB/s, under the 0.5 GB/s bar) lit the page's
    alarm while the gateway, which allows each transfer a fixed cost, stayed quiet. The page shows the
    gateway's verdict: none for those; one once transfers take longer than their bytes at the bar plus it."""
    fake = FakeEngine(metrics_text=vllm_metrics([0.004] * 4))
    async with ready_gateway_over(fake, kv_scrape_interval_s=0.2) as base:
        healthy = await state_when(base, lambda state: "kv_slow" in decode_row(state))
        fake.metrics_text = vllm_metrics([0.004] * 4 + [0.5] * 2)  # 0.1 MB in 500 ms: more than 0.2 + 100 ms
        slow = await state_when(base, lambda state: decode_row(state).get("kv_transfers") == 6)
    assert decode_row(healthy)["kv_slow"] == 0 and healthy["kv_bar_gbps"] == 0.5 and healthy["kv_allowance_ms"] == 100
    assert decode_row(slow)["kv_slow"] == 1
