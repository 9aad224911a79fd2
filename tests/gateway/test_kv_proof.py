"""A PD request whose decode engine computed the prompt again (its KV pull failed, vLLM's
kv_load_failure_policy recompute) is seen per request: in the log, the counter, `pdserve status`
and the live page; and its prefill engine leaves the rotation after repeated failed pulls."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from pdserve.gateway_address import GatewayTarget
from pdserve.status import fetch_rows, format_rows
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, post
from tests.gateway.test_faults import gateway_over, metrics_of

STREAM = {"model": MODEL, "prompt": "hi there", "max_tokens": 5, "stream": True,
          "stream_options": {"include_usage": True}}


async def test_a_recomputed_prompt_is_logged_counted_shown_and_ejects_its_prefill_engine(
        caplog: pytest.LogCaptureFixture) -> None:
    prefill, decode = FakeEngine(), FakeEngine(cached_tokens=0)  # the decode engine's pulls all fail
    async with gateway_over([prefill], [decode], eject_after_failures=3) as base:
        caplog.set_level(logging.WARNING)
        caplog.clear()
        replies = [await post(base, STREAM) for _ in range(3)]
        metrics = await metrics_of(base)
        rows = await fetch_rows(GatewayTarget(base, "the test's gateway"), headers={}, timeout_s=5)
        async with aiohttp.ClientSession() as session, session.get(base + "/dashboard/state") as reply:
            requests = (await reply.json())["requests"]
    assert all(status == 200 and payload.endswith(b"data: [DONE]\n\n") for status, payload in replies)
    # The gateway's warm-up went through both legs too, and its pull failed as well.
    pd_requests = [request for request in requests if request["mode"] == "pd"
                   and not request["request_id"].startswith("warm-up")]
    assert [request["kv"] for request in pd_requests] == ["recomputed", "recomputed"]  # the live page's rows
    not_pulled = [record.getMessage() for record in caplog.records if "KV NOT PULLED" in record.getMessage()]
    assert sorted(line.split()[0] for line in not_pulled) == sorted(
        f"request_id={request['request_id']}" for request in pd_requests)  # once each, with its id
    assert 'pdserve_kv_recomputed_total{reason="pull_failed"} 3.0' in metrics
    (prefill_row,) = [row for row in rows if row.role.value == "prefill"]
    assert prefill_row.kv_recomputed == 3 and "KV-RECOMPUTED" in format_rows(rows)
    # Three failed pulls in a row (the warm-up's and two requests') ejected the prefill engine: the third request went to the decode engine alone.
    assert any("EJECTED" in record.getMessage() and "KV pulls failed" in record.getMessage()
               for record in caplog.records)
    assert requests[0]["mode"] == "local"


async def test_a_pulled_prompt_is_shown_as_pulled_and_counts_nothing() -> None:
    prefill, decode = FakeEngine(), FakeEngine(cached_tokens=2)  # the two prompt words came as KV
    async with gateway_over([prefill], [decode]) as base:
        status, _ = await post(base, STREAM)
        metrics = await metrics_of(base)
        async with aiohttp.ClientSession() as session, session.get(base + "/dashboard/state") as reply:
            request = (await reply.json())["requests"][0]
    assert status == 200 and request["kv"] == "pulled"
    assert "pdserve_kv_recomputed_total{" not in metrics


async def test_a_stream_whose_pull_hangs_is_given_up_recomputed_on_the_same_engine_and_its_pair_ejected(
        caplog: pytest.LogCaptureFixture) -> None:
    """A link cut between the engines mid-pull hangs the pull (vLLM does not time it out); the decode
    engine is not at fault, so it is asked again, without the handoff."""
    prefill, decode = FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [decode], kv_pull_timeout_s=0.5, eject_after_failures=1) as base:
        decode.pull_gate = asyncio.Event()  # after the gateway's warm-up
        caplog.set_level(logging.WARNING)
        try:
            status, payload = await asyncio.wait_for(post(base, STREAM), timeout=10)
        finally:
            decode.pull_gate.set()  # the hung handler may end, for the fake engine to stop
        metrics = await metrics_of(base)
        async with aiohttp.ClientSession() as session, session.get(base + "/dashboard/state") as reply:
            request = (await reply.json())["requests"][0]
    assert status == 200 and b"error" not in payload and b"Hello" in payload
    assert (request["mode"], request["kv"]) == ("pd", "recomputed")
    assert 'pdserve_kv_recomputed_total{reason="pull_timeout"} 1.0' in metrics
    assert any("EJECTED" in record.getMessage() and "KV pulls failed" in record.getMessage()
               for record in caplog.records)
    retried = [body for body in decode.bodies if not body.get("kv_transfer_params")]
    assert len(retried) == 1, "the same decode engine prefilled the request itself"
