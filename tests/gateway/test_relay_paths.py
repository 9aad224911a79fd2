"""The relay's ways out, over real HTTP: after the first token, the relay thread sends the chunks
(pd/native_relay.py); without it, each chunk is written to the client from the engine socket's
read (``Relay.push``); while the client's buffer holds bytes, through the server's awaited send.
The client reads one unbroken stream every way, and the inter-token histogram counts every chunk."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from typing import Any

import aiohttp
import pytest

from pdserve.gateway.relay import Relay
from pdserve.pd.native_relay import Ending, Handback, NativeRelay
from tests.fake_engine import WORDS, FakeEngine
from tests.gateway.test_app import MODEL, post
from tests.gateway.test_faults import gateway_over, metrics_of, text_of

STREAM = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}


@pytest.fixture
def pushes(monkeypatch: pytest.MonkeyPatch) -> Counter[bool]:
    """How many chunks ``Relay.push`` wrote (True) and declined (False)."""
    counts: Counter[bool] = Counter()
    push = Relay.push

    def counted(self: Relay, chunk: bytes) -> bool:
        wrote = push(self, chunk)
        counts[wrote] += 1
        return wrote

    monkeypatch.setattr(Relay, "push", counted)
    return counts


@pytest.fixture
def handbacks(monkeypatch: pytest.MonkeyPatch) -> list[Handback]:
    """What the relay thread gave back, stream by stream."""
    seen: list[Handback] = []
    relay = NativeRelay.relay

    async def recorded(self: NativeRelay, *args: object, **kwargs: object) -> Handback:
        handback = await relay(self, *args, **kwargs)  # type: ignore[arg-type]
        seen.append(handback)
        return handback

    monkeypatch.setattr(NativeRelay, "relay", recorded)
    return seen


def itl_count(metrics: str) -> int:
    """Gaps the inter-token histogram counted, every mode."""
    return sum(int(float(count)) for count in re.findall(r"pdserve_inter_token_latency_seconds_count\{[^}]*\} (\S+)", metrics))


async def test_the_relay_thread_sends_the_chunks_after_the_first_token(
        pushes: Counter[bool], handbacks: list[Handback]) -> None:
    fake = FakeEngine(token_delay_s=0.01)
    async with gateway_over([fake], [fake]) as base:
        status, payload = await post(base, STREAM)
        metrics = await metrics_of(base)
    assert status == 200 and text_of(payload) == "".join(WORDS) and payload.endswith(b"data: [DONE]\n\n")
    # The first token goes the awaited way (it is timed as TTFT there); the thread sends the rest
    # and gives the stream back at the engine's last chunk, which completes the reply.
    assert not pushes[True] and [handback.ending for handback in handbacks] == [Ending.END]
    assert handbacks[0].token_events >= len(WORDS) - 2 and b"[DONE]" in handbacks[0].payload
    assert itl_count(metrics) >= len(WORDS) - 1  # the thread's gaps are in the histogram too


async def test_without_the_thread_the_chunks_after_the_first_token_are_written_from_the_engines_read(
        pushes: Counter[bool], handbacks: list[Handback]) -> None:
    fake = FakeEngine(token_delay_s=0.01)
    async with gateway_over([fake], [fake], native_relay=False) as base:
        status, payload = await post(base, STREAM)
    assert status == 200 and text_of(payload) == "".join(WORDS) and payload.endswith(b"data: [DONE]\n\n")
    # The first token goes the awaited way, and so may the last, when it comes in one read with
    # the reply's end; the tokens between come 10 ms apart, each written from its read.
    assert pushes[True] >= len(WORDS) - 2 and not handbacks


async def test_a_stream_the_thread_cannot_take_goes_on_in_python(
        pushes: Counter[bool], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    async def out_of_descriptors(*_args: object) -> Handback:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(NativeRelay, "relay", out_of_descriptors)
    fake = FakeEngine(token_delay_s=0.01)
    async with gateway_over([fake], [fake]) as base:
        status, payload = await post(base, STREAM)
    assert status == 200 and text_of(payload) == "".join(WORDS) and payload.endswith(b"data: [DONE]\n\n")
    assert pushes[True] >= len(WORDS) - 2  # written from the engine's reads instead
    assert sum("could not take a stream" in record.message for record in caplog.records) == 1  # once per stream


@pytest.mark.parametrize("native_relay", [True, False])
async def test_a_client_that_stops_reading_gets_every_chunk_in_order_once_it_reads_again(
        pushes: Counter[bool], handbacks: list[Handback], native_relay: bool) -> None:
    words = [f" w{index:05d}" + "x" * 300 for index in range(20_000)]  # 6.6 MB: more than the sockets' buffers hold
    fake = FakeEngine(words=words)
    # All of it may wait in the gateway (gateway.max_stream_buffer_bytes: test_stream_buffer.py ends such a stream).
    async with gateway_over([fake], [fake], native_relay=native_relay, max_stream_buffer_bytes=64 * 1024 * 1024) as base, \
            aiohttp.ClientSession(read_bufsize=4096) as session, \
            session.post(base + "/v1/completions", json=STREAM) as reply:
        await asyncio.sleep(1.0)  # reads nothing while the engine streams on
        payload = await reply.read()
    assert text_of(payload) == "".join(words) and payload.endswith(b"data: [DONE]\n\n")
    if native_relay:  # the thread met the full socket and gave the stream back with what it could not send
        assert Ending.CLIENT_BLOCKED in {handback.ending for handback in handbacks}
    else:  # both ways were taken
        assert pushes[False] > 0 and pushes[True] > 0


async def test_a_stream_the_thread_completed_is_recorded_whole_when_the_client_leaves_at_its_end_marker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The live page's "Last requests" said `cut` (1 chunk) for a complete stream: the thread sent
    every chunk, the client closed its connection at ``data: [DONE]`` (as SSE clients may, before
    the reply's last chunk), and that disconnect cancelled the relay before the loop took the
    thread's handback with the chunks' count (a loaded loop: delayed here on purpose)."""
    take = NativeRelay._take_handbacks
    monkeypatch.setattr(NativeRelay, "_take_handbacks",
                        lambda self: asyncio.get_running_loop().call_later(0.3, take, self))
    fake = FakeEngine(token_delay_s=0.01)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    async with gateway_over([fake], [fake]) as base:
        read = b""
        async with aiohttp.ClientSession() as session, session.post(base + "/v1/chat/completions", json=chat) as reply:
            async for data in reply.content.iter_any():
                read += data
                if read.endswith(b"data: [DONE]\n\n"):
                    break  # and leave: the connection closes
        await asyncio.sleep(0.6)  # the handback, had it been waited for, came meanwhile
        async with aiohttp.ClientSession() as session, session.get(base + "/dashboard/state") as reply:
            request = (await reply.json())["requests"][0]
    assert text_of(read, key="content") == "".join(WORDS)
    assert request["status"] == "ok" and request["chunks"] > 1  # the role event, then the thread's reads


def token_events_of(payload: bytes) -> int:
    """The SSE events a client read that carry a choice: not ``data: [DONE]``, not the usage-only event."""
    return sum(1 for event in payload.split(b"\n\n")
               if event.startswith(b"data: {") and json.loads(event[6:]).get("choices"))


async def dashboard_requests(base: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(base + "/dashboard/state") as reply:
        requests: list[dict[str, Any]] = (await reply.json())["requests"]
        return requests


@pytest.mark.parametrize("native_relay", [True, False])
async def test_tokens_that_come_in_bursts_count_one_gap_each(native_relay: bool) -> None:
    """An engine whose socket delivers five tokens at once: the histogram counts one gap per token event
    (the first event has none), and the page's count is the token events, not the socket's reads."""
    words = [f" w{index}" for index in range(20)]
    fake = FakeEngine(words=words, burst=5, token_delay_s=0.02)
    async with gateway_over([fake], [fake], native_relay=native_relay) as base:
        gaps_before = itl_count(await metrics_of(base))  # the readiness probe's own request
        status, payload = await post(base, {**STREAM, "max_tokens": len(words)})
        gaps = itl_count(await metrics_of(base)) - gaps_before
        request = (await dashboard_requests(base))[0]
    events = token_events_of(payload)
    assert status == 200 and text_of(payload) == "".join(words) and events >= len(words)
    assert gaps == events - 1 and request["chunks"] == events


async def test_thirty_concurrent_streams_whose_clients_leave_at_done_are_all_recorded_complete() -> None:
    """The page said `cut` with 1 chunk for complete streams: each client left at ``data: [DONE]``, which
    the relay thread had sent, before the engine's last chunk came; the cancelled relay dropped what
    the thread had relayed. Every client got its whole stream: each is recorded `ok` with its tokens."""
    fake = FakeEngine(token_delay_s=0.01, end_delay_s=0.5)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}

    async def leave_at_done(session: aiohttp.ClientSession) -> bytes:
        read = b""
        async with session.post(base + "/v1/chat/completions", json=chat) as reply:
            async for data in reply.content.iter_any():
                read += data
                if read.endswith(b"data: [DONE]\n\n"):
                    return read  # and leave: the connection closes
        return read

    async with gateway_over([fake], [fake]) as base:
        before = len(await dashboard_requests(base))  # the readiness probe's own requests
        async with aiohttp.ClientSession() as session:
            payloads = await asyncio.gather(*(leave_at_done(session) for _ in range(30)))
        deadline_s = asyncio.get_running_loop().time() + 10
        while (len(requests := await dashboard_requests(base)) < before + 30
               and asyncio.get_running_loop().time() < deadline_s):
            await asyncio.sleep(0.05)
        requests = requests[:30]  # newest first
    assert all(text_of(payload, key="content") == "".join(WORDS) for payload in payloads)
    assert [request["status"] for request in requests] == ["ok"] * 30
    assert [request["chunks"] for request in requests] == [token_events_of(payloads[0])] * 30


@pytest.mark.parametrize("native_relay", [True, False])
async def test_a_stream_the_engine_aborts_ends_in_an_error_event_and_is_recorded_so(native_relay: bool) -> None:
    """Ctrl-C on `pdserve up` with streams in flight: vLLM stops and ends each with finish_reason "abort" and
    [DONE] (v1/engine/output_processor.py, FinishReason.ABORT), which clients took for a finished reply and the
    page recorded `ok`. The gateway treats it as the engine's error event: the stream moves on if another decode
    engine can take it, else ends in an error event, recorded with its code."""
    fake = FakeEngine(token_delay_s=0.01, abort_after=3)
    async with gateway_over([fake], [fake], native_relay=native_relay) as base:
        status, payload = await post(base, STREAM)
        request = (await dashboard_requests(base))[0]
    events = payload.split(b"\n\n")
    assert status == 200 and text_of(payload.split(b'data: {"error"')[0]) == "".join(WORDS[:3])
    assert b'"abort"' not in payload and b'"code": "decode_stream_failed"' in events[-3] and events[-2] == b"data: [DONE]"
    assert request["status"] == "decode_stream_failed" and request["chunks"] == 3


async def test_requests_are_counted_under_the_mode_that_served_them() -> None:
    """A request that did not ask for a mode was counted `mode="auto"` though it ran disaggregated."""
    fake = FakeEngine()
    async with gateway_over([fake], [fake]) as base:
        assert (await post(base, STREAM))[0] == 200
        assert (await post(base, STREAM, headers={"X-PD-Mode": "local"}))[0] == 200
        metrics = await metrics_of(base)
    counted = dict(re.findall(r'pdserve_requests_total\{mode="(\w+)",route="/v1/completions",status="200"\} (\S+)',
                              metrics))
    assert "auto" not in counted and float(counted["pd"]) >= 1 and float(counted["local"]) == 1
