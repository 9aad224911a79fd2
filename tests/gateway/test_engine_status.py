"""GET /admin/engines and `pdserve status` against a gateway over a fake engine that reports load."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from pdserve.access import ADMIN_KEY_ENV, API_KEYS_ENV
from pdserve.gateway.app import build_app
from pdserve.gateway_config import RoutingSpec
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, gateway_settings, post, until_ready
from tests.routing.test_load import vllm_load_metrics

ADMIN_KEY, CLIENT_KEY = "sk-admin-0123456789abcdef", "sk-client-0123456789abcdef"


async def get_engines(base: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(base + "/admin/engines", headers=headers) as reply:
        return reply.status, json.loads(await reply.read())


async def until_load_read(base: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The rows once the gateway has read both engines' load."""
    for _ in range(100):
        status, body = await get_engines(base, headers)
        assert status == 200
        if all(row["running"] is not None for row in body["engines"]):
            return list(body["engines"])
        await asyncio.sleep(0.05)
    raise AssertionError("the gateway never read the engines' load")


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[str, str]]:
    """A ready gateway reading load every 0.1 s from a fake engine serving both roles; yields (gateway, engine)."""
    fake = FakeEngine(metrics_text=vllm_load_metrics(running=2, waiting=1, kv_usage=0.25, queried=400, hits=100))
    async with serving(fake.app(), free_port()) as url:
        settings = gateway_settings(prefill=[url], decode=[url])
        settings = settings.model_copy(update={"routing": RoutingSpec(load_scrape_interval_s=0.1)})
        async with serving(build_app(settings), settings.gateway.port) as base:
            await until_ready(base)
            yield base, url


async def test_admin_engines_lists_each_engine_with_its_load_and_legs(gateway: tuple[str, str]) -> None:
    base, url = gateway
    rows = await until_load_read(base)
    assert [(row["role"], row["url"], row["is_healthy"]) for row in rows] == [("prefill", url, True), ("decode", url, True)]
    for row in rows:
        assert (row["running"], row["waiting"], row["kv_usage"], row["prefix_hit_rate"]) == (2, 1, 0.25, 0.25)
        assert 0 <= row["load_age_s"] < 5
    routed_before = [row["routed"] for row in rows]
    assert (await post(base, {"model": MODEL, "prompt": "hi", "max_tokens": 5}, headers={"X-PD-Mode": "pd"}))[0] == 200
    _, body = await get_engines(base)
    assert [row["routed"] for row in body["engines"]] == [count + 1 for count in routed_before]


async def test_admin_engines_needs_the_admin_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)
    monkeypatch.setenv(API_KEYS_ENV, CLIENT_KEY)
    async with serving(FakeEngine().app(), free_port()) as url:
        settings = gateway_settings(prefill=[url], decode=[url])
        async with serving(build_app(settings), settings.gateway.port) as base:
            for headers in (None, {"Authorization": f"Bearer {CLIENT_KEY}"}):
                status, body = await get_engines(base, headers)
                assert status == 401 and body["error"]["code"] == "invalid_api_key"
                assert url not in json.dumps(body)
            status, body = await get_engines(base, {"Authorization": f"Bearer {ADMIN_KEY}"})
            assert status == 200 and [row["url"] for row in body["engines"]] == [url, url]


async def pdserve(*args: str) -> tuple[int, str, str]:
    """The CLI in a child process, awaited so the gateway in this event loop goes on answering."""
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "pdserve", *args,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_pdserve_status_prints_a_table_and_json(gateway: tuple[str, str]) -> None:
    base, url = gateway
    await until_load_read(base)
    code, table, _ = await pdserve("status", "--gateway-url", base)
    header, *lines = table.splitlines()
    assert code == 0 and header.split() == ["ROLE", "ADDRESS", "HEALTH", "RUNNING", "WAITING", "KV-USAGE",
                                            "PREFIX-HIT", "ROUTED", "KV-RECOMPUTED"]
    address = url.removeprefix("http://")
    assert [line.split()[:7] for line in lines] == [[role, address, "healthy", "2", "1", "25%", "25%"]
                                                    for role in ("prefill", "decode")]
    code, text, _ = await pdserve("status", "--gateway-url", base, "--json")
    assert code == 0 and [row["role"] for row in json.loads(text)["engines"]] == ["prefill", "decode"]


async def test_pdserve_status_says_why_when_no_gateway_answers() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, _, stderr = await pdserve("status", "--gateway-url", url, "--timeout-s", "5")
    assert code == 1 and stderr.startswith(f"error: no gateway answers at {url} (from --gateway-url)")
