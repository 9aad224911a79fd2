"""The relay's two ways out, over real HTTP: a chunk written to the client from the engine socket's
read (``Relay.push``), or, while the client's buffer holds bytes, through the server's awaited send.
The client reads one unbroken stream either way."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest

from pdserve.gateway.relay import Relay
from tests.fake_engine import WORDS, FakeEngine
from tests.gateway.test_app import MODEL, post
from tests.gateway.test_faults import gateway_over, text_of


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


async def test_the_chunks_after_the_first_token_are_written_from_the_engines_read(pushes: Counter[bool]) -> None:
    fake = FakeEngine(token_delay_s=0.01)
    async with gateway_over([fake], [fake]) as base:
        status, payload = await post(base, {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True})
    assert status == 200 and text_of(payload) == "".join(WORDS) and payload.endswith(b"data: [DONE]\n\n")
    # The first token goes the awaited way (it is timed as TTFT there), and so may the last, when it
    # comes in one read with the reply's end; the tokens between come 10 ms apart, each written from its read.
    assert pushes[True] >= len(WORDS) - 2


async def test_a_client_that_stops_reading_gets_every_chunk_in_order_once_it_reads_again(pushes: Counter[bool]) -> None:
    words = [f" w{index:05d}" + "x" * 300 for index in range(20_000)]  # 6.6 MB: more than the sockets' buffers hold
    fake = FakeEngine(words=words)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}
    async with gateway_over([fake], [fake]) as base, aiohttp.ClientSession(read_bufsize=4096) as session, \
            session.post(base + "/v1/completions", json=body) as reply:
        await asyncio.sleep(1.0)  # reads nothing while the engine streams on
        payload = await reply.read()
    assert text_of(payload) == "".join(words) and payload.endswith(b"data: [DONE]\n\n")
    assert pushes[False] > 0 and pushes[True] > 0  # both ways were taken, and the text is whole and in order
