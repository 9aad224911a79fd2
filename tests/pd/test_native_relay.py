"""The C relay thread on socket pairs: what it sends on, where it stops, and what it gives back."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.pd import native_relay
from pdserve.pd.native_relay import Ending, NativeRelay, RelayCancelled, Ticket

BOUNDS_S = (0.001, 0.01, 0.1, 0.5, 1.0)
TICKET = Ticket(previous_s=0.0, deadline_s=float("inf"), idle_timeout_s=30.0, watch_usage=False)
LAST = b"0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def event(text: str) -> bytes:
    return b'data: {"choices":[{"text":"%b"}]}\n\n' % text.encode()


@pytest.fixture
async def native() -> AsyncIterator[NativeRelay]:
    relay = NativeRelay(BOUNDS_S)
    yield relay
    relay.close()


@pytest.fixture
def sockets() -> Iterator[tuple[socket.socket, socket.socket, socket.socket, socket.socket]]:
    """(engine, engine's gateway end, client's gateway end, client): the relay reads the second, writes the third."""
    engine, engine_side = socket.socketpair()
    client_side, client = socket.socketpair()
    yield engine, engine_side, client_side, client
    for sock in (engine, engine_side, client_side, client):
        sock.close()


def received_so_far(sock: socket.socket) -> int:
    """How many bytes wait in ``sock``'s receive buffer, left there."""
    try:
        return len(sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return 0


def received(sock: socket.socket) -> bytes:
    """All that waits in ``sock``'s receive buffer."""
    sock.setblocking(False)
    data = b""
    while True:
        try:
            piece = sock.recv(1 << 20)
        except BlockingIOError:
            return data
        if not piece:
            return data
        data += piece


async def test_complete_chunks_go_on_as_they_came_and_the_last_one_comes_back(native: NativeRelay, sockets) -> None:
    engine, engine_side, client_side, client = sockets
    relaying = asyncio.ensure_future(native.relay(engine_side.fileno(), client_side.fileno(), TICKET))
    engine.sendall(chunk(event("a")) + chunk(event("b"))[:7])  # the second chunk cut mid-data
    await asyncio.sleep(0.05)
    engine.sendall(chunk(event("b"))[7:])
    await asyncio.sleep(0.05)
    engine.sendall(chunk(b"data: [DONE]\n\n") + LAST)
    back = await asyncio.wait_for(relaying, 5)
    assert back.ending is Ending.END and back.leftover == LAST and back.unsent == b""
    assert received(client) == chunk(event("a")) + chunk(event("b")) + chunk(b"data: [DONE]\n\n")
    assert back.payload == event("a") + event("b") + b"data: [DONE]\n\n"
    assert back.token_events == 2 and sum(back.gap_counts) == 2  # the cut chunk went on once, whole; [DONE] is no token


async def test_an_error_event_comes_back_from_its_own_chunk_on(native: NativeRelay, sockets) -> None:
    engine, engine_side, client_side, client = sockets
    relaying = asyncio.ensure_future(native.relay(engine_side.fileno(), client_side.fileno(), TICKET))
    error = chunk(b'data: {"error": {"message": "engine core died"}}\n\n')
    engine.sendall(chunk(event("a")) + error + LAST)
    back = await asyncio.wait_for(relaying, 5)
    assert back.ending is Ending.HANDBACK and back.leftover == error + LAST
    assert received(client) == chunk(event("a")) and back.payload == event("a")


@pytest.mark.parametrize("watch_usage", [True, False])
async def test_the_usage_event_comes_back_only_when_watched(native: NativeRelay, sockets, watch_usage: bool) -> None:
    engine, engine_side, client_side, client = sockets
    ticket = replace(TICKET, watch_usage=watch_usage)
    relaying = asyncio.ensure_future(native.relay(engine_side.fileno(), client_side.fileno(), ticket))
    usage = chunk(b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n')
    engine.sendall(chunk(event("a")) + usage + LAST)
    back = await asyncio.wait_for(relaying, 5)
    if watch_usage:
        assert back.ending is Ending.HANDBACK and back.leftover == usage + LAST
        assert received(client) == chunk(event("a"))
    else:
        assert back.ending is Ending.END and received(client) == chunk(event("a")) + usage


async def test_a_chunk_past_the_deadline_comes_back_unsent(native: NativeRelay, sockets) -> None:
    engine, engine_side, client_side, client = sockets
    ticket = replace(TICKET, deadline_s=time.perf_counter())
    relaying = asyncio.ensure_future(native.relay(engine_side.fileno(), client_side.fileno(), ticket))
    engine.sendall(chunk(event("a")))
    back = await asyncio.wait_for(relaying, 5)
    assert back.ending is Ending.HANDBACK and back.leftover == chunk(event("a")) and back.token_events == 0
    assert received(client) == b""


async def test_an_engine_that_closes_mid_chunk_comes_back_lost_with_the_cut_chunk(native: NativeRelay, sockets) -> None:
    engine, engine_side, client_side, client = sockets
    relaying = asyncio.ensure_future(native.relay(engine_side.fileno(), client_side.fileno(), TICKET))
    engine.sendall(chunk(event("a")) + chunk(event("b"))[:5])
    await asyncio.sleep(0.05)
    engine.close()
    back = await asyncio.wait_for(relaying, 5)
    assert back.ending is Ending.ENGINE_LOST and back.leftover == chunk(event("b"))[:5]
    assert received(client) == chunk(event("a"))


async def test_a_silent_engine_comes_back_idle(native: NativeRelay, sockets) -> None:
    _, engine_side, client_side, _ = sockets
    ticket = replace(TICKET, idle_timeout_s=0.2)
    started_s = time.monotonic()
    back = await asyncio.wait_for(native.relay(engine_side.fileno(), client_side.fileno(), ticket), 5)
    assert back.ending is Ending.IDLE and 0.2 <= time.monotonic() - started_s < 1.0
    assert back.last_bytes_s <= started_s + 0.1  # nothing came: the clock started at the handover


async def test_a_client_that_does_not_read_gets_the_rest_back_as_unsent(native: NativeRelay, sockets) -> None:
    engine, engine_side, client_side, client = sockets
    client_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    relaying = asyncio.ensure_future(native.relay(engine_side.fileno(), client_side.fileno(), TICKET))
    chunks = [chunk(event(f"{index:04d}" + "x" * 1000)) for index in range(200)]
    engine.setblocking(False)
    sent = b""
    for piece in chunks:
        try:
            engine.sendall(piece)
        except BlockingIOError:
            break
        sent += piece
        await asyncio.sleep(0)
    back = await asyncio.wait_for(relaying, 5)
    assert back.ending is Ending.CLIENT_BLOCKED and back.unsent
    # What reached the client, then what it still owes, then what was not read as a whole chunk: all of it, in order.
    assert received(client) + back.unsent + back.leftover + received(engine_side) == sent


async def test_a_cancelled_relay_lets_go_of_both_sockets_and_gives_back_what_it_relayed(
        native: NativeRelay, sockets) -> None:
    """A client that leaves at ``data: [DONE]`` cancels the relay before the engine's last chunk: what
    the thread sent still comes back for the request's record (it was dropped, and the page said `cut`)."""
    engine, engine_side, client_side, client = sockets
    relaying = asyncio.ensure_future(native.relay(engine_side.fileno(), client_side.fileno(), TICKET))
    engine.sendall(chunk(event("z")) + chunk(b"data: [DONE]\n\n"))
    deadline_s = time.monotonic() + 5
    while received_so_far(client) < len(chunk(event("z")) + chunk(b"data: [DONE]\n\n")) and time.monotonic() < deadline_s:
        await asyncio.sleep(0.01)
    relaying.cancel()
    with pytest.raises(RelayCancelled) as cancelled:
        await relaying
    back = cancelled.value.handback
    assert back.ending is Ending.CANCELLED and back.payload == event("z") + b"data: [DONE]\n\n"
    assert back.token_events == 1
    await asyncio.sleep(0.05)
    engine.sendall(chunk(event("a")))
    await asyncio.sleep(0.05)
    assert received(client) == chunk(event("z")) + chunk(b"data: [DONE]\n\n")  # and nothing since: not relayed
    assert engine_side.recv(1024) == chunk(event("a"))  # and the bytes wait, unread, for their owner


async def test_each_relayed_read_counts_one_gap_in_its_bucket(native: NativeRelay, sockets) -> None:
    engine, engine_side, client_side, _ = sockets
    ticket = replace(TICKET, previous_s=time.perf_counter() - 0.3)  # the first gap: about 0.3 s, in (0.1, 0.5]
    relaying = asyncio.ensure_future(native.relay(engine_side.fileno(), client_side.fileno(), ticket))
    engine.sendall(chunk(event("a")))
    await asyncio.sleep(0.05)
    engine.sendall(LAST)
    back = await asyncio.wait_for(relaying, 5)
    assert back.gap_counts == (0, 0, 0, 1, 0, 0) and 0.3 <= back.gap_sum_s < 0.5
    assert back.previous_s <= time.perf_counter()


async def test_a_burst_counts_one_gap_per_token_event_the_first_its_gap_the_others_zero(
        native: NativeRelay, sockets) -> None:
    """Five token events in one read (two of them in one chunk), then the usage-only event and [DONE]:
    five gaps, about 0.3 s for the first and 0 for the others; the last two are no tokens."""
    engine, engine_side, client_side, _ = sockets
    ticket = replace(TICKET, previous_s=time.perf_counter() - 0.3)
    relaying = asyncio.ensure_future(native.relay(engine_side.fileno(), client_side.fileno(), ticket))
    usage = chunk(b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3}}\n\n')
    engine.sendall(chunk(event("a")) + chunk(event("b") + event("c")) + chunk(event("d")) + chunk(event("e"))
                   + usage + chunk(b"data: [DONE]\n\n") + LAST)
    back = await asyncio.wait_for(relaying, 5)
    assert back.ending is Ending.END and back.token_events == 5
    assert back.gap_counts == (4, 0, 0, 1, 0, 0) and 0.3 <= back.gap_sum_s < 0.5


async def test_an_install_without_the_module_relays_in_python_and_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert native_relay.start(BOUNDS_S, enabled=False) is None
    assert not caplog.records  # turned off: nothing to say
    monkeypatch.setattr(native_relay, "_chunk_relay", None)
    monkeypatch.setattr(native_relay, "_MISSING", "No module named 'pdserve.pd._chunk_relay'", raising=False)
    assert native_relay.start(BOUNDS_S, enabled=True) is None
    assert "was not built with this install" in caplog.text and "No module named" in caplog.text


events = st.lists(st.binary(min_size=1, max_size=300).filter(lambda data: b"usage" not in data and b"error" not in data),
                  min_size=1, max_size=12)


@given(data=events, cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=8),
       error_at=st.none() | st.integers(min_value=0, max_value=11))
@settings(max_examples=40, deadline=None)
def test_a_reply_cut_anywhere_goes_on_whole_chunks_in_order_and_stops_where_python_must_see(
        data: list[bytes], cuts: list[int], error_at: int | None) -> None:
    """Whatever the reads: the client gets whole chunks, in order, up to the reply's end or the first error
    event; what comes back starts at the chunk that stopped it; nothing is sent twice or lost."""
    if error_at is not None and error_at < len(data):
        data[error_at] = b'data: {"error": {"message": "engine core died"}}\n\n'
    frames = [chunk(event) for event in data]
    stop = next((index for index, event in enumerate(data) if event.startswith(b'data: {"error"')), len(data))
    wire = b"".join(frames) + LAST
    asyncio.run(relay_in_pieces(wire, cuts, expected_sent=b"".join(frames[:stop]),
                                expected_payload=b"".join(data[:stop]), ending=Ending.END if stop == len(data) else Ending.HANDBACK))


async def relay_in_pieces(wire: bytes, cuts: list[int], *, expected_sent: bytes, expected_payload: bytes,
                          ending: Ending) -> None:
    native = NativeRelay(BOUNDS_S)
    engine, engine_side = socket.socketpair()
    client_side, client = socket.socketpair()
    try:
        relaying = asyncio.ensure_future(native.relay(engine_side.fileno(), client_side.fileno(), TICKET))
        start = 0
        for cut in [*cuts, len(wire)]:
            engine.sendall(wire[start:start + cut])
            start += cut
            await asyncio.sleep(0.002)  # each piece its own read, most of the time
            if start >= len(wire):
                break
        back = await asyncio.wait_for(relaying, 5)
        assert back.ending is ending and back.unsent == b""
        assert received(client) == expected_sent and back.payload == expected_payload
        assert expected_sent + back.leftover + received(engine_side) == wire  # the rest, from the stopping chunk on
    finally:
        native.close()
        for sock in (engine, engine_side, client_side, client):
            sock.close()


def test_the_endings_are_the_c_modules_constants() -> None:
    assert {ending.name: ending.value for ending in Ending} == {
        ending.name: getattr(native_relay._chunk_relay, ending.name) for ending in Ending}
