"""pdserve's gateway in front of the synthetic upstream: every streamed byte arrives, metrics count it."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import aiohttp
import pytest

from pdserve.bench import runner
from pdserve.bench.upstream import Pace, Upstream, reply_text, serving_upstream
from pdserve.bench.workload import COMPLETIONS, BenchRequest
from pdserve.config import parse_settings
from pdserve.gateway.app import build_app
from tests.conftest import free_port, serving
from tests.gateway.test_app import until_ready

MODEL = "pdserve-demo"
TOKENS = 12


@pytest.fixture
async def gateway_and_upstream() -> AsyncIterator[tuple[str, Upstream]]:
    async with serving_upstream(Pace(ttft_s=0.01, tokens_per_s=500.0)) as upstream:
        url = upstream.url
        settings = parse_settings({
            "prefill": {"engines": 0, "base_port": 1, "urls": [url]},
            "decode": {"engines": 0, "base_port": 2, "urls": [url]},
            "gateway": {"port": free_port()}, "cache_dir": "/tmp",
        }, source="test")
        async with serving(build_app(settings), settings.gateway.port) as gateway:
            await until_ready(gateway)
            upstream.counts.prefill = upstream.counts.decode = 0  # the gateway's warm-up
            yield gateway, upstream


async def test_gateway_relays_the_stream_intact_and_counts_it(
    gateway_and_upstream: tuple[str, Upstream],
) -> None:
    gateway, upstream = gateway_and_upstream
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as session:
        async with session.post(gateway + COMPLETIONS, json=body) as reply:
            assert reply.status == 200
            events = (await reply.read()).decode().split("\n\n")
        async with session.get(gateway + "/metrics") as reply:
            metrics = await reply.text()
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert events[-2:] == ["data: [DONE]", ""]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]) == reply_text(TOKENS)
    assert chunks[-1]["usage"]["completion_tokens"] == TOKENS
    counts = upstream.counts
    assert (counts.prefill, counts.decode, counts.whole) == (1, 1, 0)
    assert _sample(metrics, "pdserve_requests_total", 'route="/v1/completions"', 'status="200"') == 1
    assert _sample(metrics, "pdserve_time_to_first_token_seconds_count", 'mode="pd"') == 3  # and the two warm-ups'
    assert _sample(metrics, "pdserve_inter_token_latency_seconds_count", 'mode="pd"') >= 1  # chunks may coalesce
    assert _sample(metrics, "pdserve_first_tokens_total", 'route="/v1/completions"',
                   'source="prefill"') == 1  # it came with the prefill leg


async def test_load_generator_sees_every_token_through_the_gateway(
    gateway_and_upstream: tuple[str, Upstream],
) -> None:
    gateway, _ = gateway_and_upstream
    request = BenchRequest(COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": TOKENS, "stream": True,
                                         "stream_options": {"include_usage": True}})
    async with runner.new_session() as session:
        records = [await runner.send(session, "gateway", gateway, request, timeout_s=10) for _ in range(3)]
    assert all(record.error is None and record.output_tokens == TOKENS for record in records)


def _sample(metrics: str, name: str, *labels: str) -> float:
    """The value of the one sample of ``name`` whose labels include all of ``labels``."""
    values = [float(match.group(2)) for match in re.finditer(rf"^{name}(?:\{{(.*)\}})? (\S+)$", metrics, re.MULTILINE)
              if all(label in (match.group(1) or "") for label in labels)]
    assert len(values) == 1, f"{name} {labels}: {values}"
    return values[0]
