"""The lean closed-loop client of the load processes: what it records matches what the upstream sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from pdserve.bench.runner import CLIENT_KEY_ENV, Target, new_session, send
from pdserve.bench.streams import run_streams
from pdserve.bench.upstream import Pace, Upstream, serving_upstream
from pdserve.bench.workload import CHAT, COMPLETIONS, BenchRequest
from tests.conftest import free_port

TOKENS = 9


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    async with serving_upstream(Pace(ttft_s=0.01, tokens_per_s=500.0)) as served:
        yield served


def streamed(path: str, **fields: object) -> BenchRequest:
    body = {"model": "m", "max_tokens": TOKENS, "stream": True, "stream_options": {"include_usage": True}, **fields}
    return BenchRequest(path, body)


async def test_each_stream_sends_its_next_request_when_the_last_ends(upstream: Upstream) -> None:
    requests = iter([streamed(COMPLETIONS, prompt="a b"), streamed(CHAT, messages=[{"role": "user", "content": "x"}])]
                    * 100)
    records = await run_streams(Target("up", (upstream.url,)), requests, streams=3, stagger_s=0.0,
                                stop_s=time.perf_counter() + 0.1, timeout_s=5.0)
    assert len(records) >= 3 and upstream.counts.whole == len(records)
    for record in records:
        assert record.error is None, record.error
        assert record.output_tokens == TOKENS and len(record.token_times_s) == TOKENS  # the chat role is no token
        assert record.ttft_s is not None and record.ttft_s >= 0.01
    for record in records:  # closed loop: never more than 3 in flight
        assert sum(1 for other in records if other.sent_s <= record.sent_s < other.done_s) <= 3


async def test_a_failing_target_becomes_errors_not_exceptions(upstream: Upstream) -> None:
    stop_s = time.perf_counter() + 0.05
    missing = await run_streams(Target("up", (upstream.url,)), iter([BenchRequest("/v1/nothing", {})] * 10),
                                streams=1, stagger_s=0.0, stop_s=stop_s, timeout_s=5.0)
    assert missing and all((record.error or "").startswith("HTTP 404") for record in missing)
    dead = await run_streams(Target("dead", (f"http://127.0.0.1:{free_port()}",)),
                             iter([streamed(COMPLETIONS, prompt="a")] * 10), streams=1, stagger_s=0.0,
                             stop_s=time.perf_counter() + 0.05, timeout_s=5.0)
    assert dead and all("ConnectionRefusedError" in (record.error or "") for record in dead)


async def test_a_reply_slower_than_the_timeout_is_an_error() -> None:
    async with serving_upstream(Pace(ttft_s=1.0)) as slow:
        records = await run_streams(Target("slow", (slow.url,)), iter([streamed(COMPLETIONS, prompt="a")] * 5),
                                    streams=1, stagger_s=0.0, stop_s=time.perf_counter() + 0.02, timeout_s=0.05)
    assert [record.error for record in records] == ["TimeoutError: no complete reply in 0.05 s"]


async def test_both_load_clients_send_the_api_key_openai_clients_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway with keys answers 401 to a load without one: OPENAI_API_KEY rides on every request."""
    heads: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    monkeypatch.setenv(CLIENT_KEY_ENV, "sk-load-key-0123456789")
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        await run_streams(Target("up", (url,)), iter([streamed(COMPLETIONS, prompt="a")]), streams=1, stagger_s=0.0,
                          stop_s=time.perf_counter() + 0.01, timeout_s=5.0)
        async with new_session() as session:
            await send(session, "up", url, streamed(COMPLETIONS, prompt="a"), timeout_s=5.0)
    assert len(heads) >= 2  # at least one from each client
    assert all(b"\r\nAuthorization: Bearer sk-load-key-0123456789\r\n" in head for head in heads), heads
