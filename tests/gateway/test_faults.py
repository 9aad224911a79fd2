"""Engine faults over real HTTP against fake engines: what the client sees and what each engine was sent.

The same faults against real vLLM engines, with their KV usage afterwards: tests/e2e/test_faults.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest

from pdserve.gateway.app import build_app
from pdserve.pd.decode import RELEASE_MODEL
from tests.conftest import free_port, serving
from tests.fake_engine import KV_PARAMS, WORDS, FakeEngine
from tests.gateway.test_app import MODEL, gateway_settings, post, until_ready


@asynccontextmanager
async def gateway_over(prefill: list[FakeEngine], decode: list[FakeEngine], **gateway: Any) -> AsyncIterator[str]:
    """A ready gateway in front of these fake engines (their warm-up bodies cleared); yields its URL."""
    async with AsyncExitStack() as stack:
        fakes = list({id(fake): fake for fake in prefill + decode}.values())
        urls = {id(fake): await stack.enter_async_context(serving(fake.app(), free_port())) for fake in fakes}
        settings = gateway_settings(prefill=[urls[id(fake)] for fake in prefill],
                                    decode=[urls[id(fake)] for fake in decode], **gateway)
        base = await stack.enter_async_context(serving(build_app(settings), settings.gateway.port))
        await until_ready(base)
        for fake in fakes:
            fake.bodies.clear()
        yield base


async def metrics_of(base: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as reply:
        return await reply.text()


def text_of(payload: bytes, *, key: str = "text") -> str:
    """The generated text of an SSE reply; fails on an error event."""
    pieces = []
    for event in payload.decode().split("\n\n"):
        if event.startswith("data: {"):
            data = json.loads(event[6:])
            assert "error" not in data, data
            choice = data["choices"][0]
            pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


async def test_prefill_engine_failing_falls_back_to_prefill_on_the_decode_engine() -> None:
    prefill, decode = FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [decode]) as base:
        prefill.reject_status = 500
        status, payload = await post(base, {"model": MODEL, "prompt": "hi", "stream": True})
        metrics = await metrics_of(base)
    assert status == 200 and text_of(payload) == "".join(WORDS)
    assert "kv_transfer_params" not in decode.bodies[-1]  # the decode engine prefilled it itself
    assert 'pdserve_local_fallbacks_total{reason="prefill_failed"} 1.0' in metrics


async def test_no_reachable_prefill_engine_falls_back_and_the_fallback_can_be_turned_off() -> None:
    decode = FakeEngine()
    dead = f"http://127.0.0.1:{free_port()}"
    async with serving(decode.app(), free_port()) as url:
        for local_fallback, expected in ((True, 200), (False, 503)):  # 503: no prefill engine answers
            settings = gateway_settings(prefill=[dead], decode=[url], local_fallback=local_fallback)
            async with serving(build_app(settings), settings.gateway.port) as base:
                status, _ = await post(base, {"model": MODEL, "prompt": "hi"})
            assert status == expected


async def test_decode_engine_dying_before_its_first_token_restarts_the_request_on_another() -> None:
    prefill, broken, healthy = FakeEngine(), FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [broken, healthy]) as base:
        broken.break_stream_after = 0
        replies = []
        while not broken.bodies and len(replies) < 16:  # until a prompt's home is the broken engine
            replies.append(await post(base, {"model": MODEL, "prompt": f"hi {len(replies)}", "stream": True}))
        metrics = await metrics_of(base)
    assert [(status, text_of(payload)) for status, payload in replies] == [(200, "".join(WORDS))] * len(replies)
    assert broken.bodies, "homes spread: one of the prompts went to the broken engine first"
    restarted = [body for body in healthy.bodies if "kv_transfer_params" not in body]
    assert len(restarted) == len(broken.bodies)  # each one restarted whole on the healthy engine, prefilled there
    assert f'pdserve_decode_switches_total{{kind="restarted"}} {len(broken.bodies)}.0' in metrics


async def test_mid_stream_failure_continues_on_the_other_decode_engine() -> None:
    prefill, a, b = FakeEngine(), FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [a, b]) as base:
        a.break_stream_after = b.break_stream_after = 2  # after the gateway's warm-ups
        status, payload = await post(base, {"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 9})
        metrics = await metrics_of(base)
    assert status == 200
    resumed = [body for body in a.bodies + b.bodies if body.get("prompt") != "hi"]
    assert len(resumed) == 1 and resumed[0]["prompt"] == "hi" + "".join(WORDS[:2])
    assert resumed[0]["max_tokens"] == 7 and "kv_transfer_params" not in resumed[0]
    # The second engine broke too, after its own two words: the client got four, then the error.
    assert text_of(payload.split(b"data: {\"error\"")[0]) == "".join(WORDS[:2]) * 2
    assert 'pdserve_decode_switches_total{kind="resumed"} 1.0' in metrics


async def test_a_broken_stream_waits_for_the_other_decode_engine_to_recover_rather_than_ending() -> None:
    prefill, breaking, recovering = FakeEngine(), FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [breaking, recovering], unhealthy_after_failures=1) as base:
        recovering.health_status = 503  # its probes fail while the stream starts, and after it breaks
        while await healthy_decode_engines(base) != 1:
            await asyncio.sleep(0.05)
        breaking.break_stream_after = 2
        breaking.pause_after, breaking.pause_s = 1, 0.6  # the stream breaks once the gateway waits for its next chunk

        async def recover() -> None:
            while len(breaking.bodies) == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)  # past the break: the gateway waits
            recovering.health_status = 200

        recovery = asyncio.create_task(recover())
        status, payload = await post(base, {"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 9})
        await recovery
        metrics = await metrics_of(base)
    # Two words from the engine that broke, then the recovered one's: the fake starts its words over.
    assert status == 200 and text_of(payload) == "".join(WORDS[:2]) + "".join(WORDS[:7])
    resumed = [body for body in recovering.bodies if "kv_transfer_params" not in body]  # not the handoff's release
    assert payload.endswith(b"data: [DONE]\n\n") and [body["prompt"] for body in resumed] == ["hi" + "".join(WORDS[:2])]
    assert 'pdserve_decode_switches_total{kind="resumed"} 1.0' in metrics


async def healthy_decode_engines(base: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(base + "/health") as reply:
        return int((await reply.json())["healthy_engines"]["decode"])


@pytest.mark.parametrize("native_relay", [True, False])  # the relay thread's idle end, and the event loop's
async def test_a_silent_decode_engine_keeps_a_stream_no_other_engine_can_take(native_relay: bool) -> None:
    prefill, slow = FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [slow], decode_idle_timeout_s=0.2, native_relay=native_relay) as base:
        slow.pause_after, slow.pause_s = 2, 0.7  # three idle timeouts' worth: waited on each time
        status, payload = await post(base, {"model": MODEL, "prompt": "hi", "stream": True})
        metrics = await metrics_of(base)
    assert status == 200 and text_of(payload) == "".join(WORDS) and payload.endswith(b"data: [DONE]\n\n")
    assert slow.streams_closed_early == 0 and len(slow.bodies) == 1  # neither aborted nor sent again
    assert "pdserve_decode_switches_total{" not in metrics


@pytest.mark.parametrize("native_relay", [True, False])
async def test_a_silent_decode_engine_keeps_its_stream_only_until_the_request_deadline(native_relay: bool) -> None:
    prefill, slow = FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [slow], decode_idle_timeout_s=0.1, request_timeout_s=0.5,
                            first_token_timeout_s=600, native_relay=native_relay) as base:
        slow.pause_after, slow.pause_s = 2, 600
        # Kept mid-stream, the engine is waited on as between two tokens, not for a first token's 600 s.
        status, payload = await asyncio.wait_for(post(base, {"model": MODEL, "prompt": "hi", "stream": True}), 60)
        closed_early = await slow.closed_early_within()
    assert status == 200 and b"request_timeout" in payload and payload.endswith(b"data: [DONE]\n\n")
    assert closed_early == 1  # aborted on the engine once the deadline passed


async def test_an_engine_ending_its_stream_with_its_own_error_event_is_resumed_on_the_other() -> None:
    prefill, failing, healthy = FakeEngine(), FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [failing, healthy]) as base:
        failing.error_event_after = 2  # after the warm-up: vLLM's event when its engine core died mid-stream
        for number in range(16):  # until a prompt's home is the failing engine
            prompt = f"hi {number}"
            status, payload = await post(base, {"model": MODEL, "prompt": prompt, "stream": True, "max_tokens": 9})
            assert status == 200 and b'"error"' not in payload and payload.endswith(b"data: [DONE]\n\n")
            if failing.bodies:
                break
        metrics = await metrics_of(base)
    # The healthy engine continued after the two words sent (a fake: it says all its words again).
    assert text_of(payload) == "".join(WORDS[:2] + WORDS)
    assert healthy.bodies[-1]["prompt"] == prompt + "".join(WORDS[:2])
    assert 'pdserve_decode_switches_total{kind="resumed"} 1.0' in metrics


async def test_a_stream_moving_off_a_failed_engine_is_not_queued_behind_a_full_one() -> None:
    prefill, a, b = FakeEngine(), FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [a, b], max_in_flight_per_engine=1, queue_timeout_s=0.3) as base:
        for engine in (a, b):
            engine.words, engine.token_delay_s = WORDS * 4, 0.1  # 2 s a stream: far past the queue's 0.3 s
        body = {"model": MODEL, "prompt": "hi", "stream": True}
        holder = asyncio.create_task(post(base, {**body, "prompt": "holds a slot"}))
        while not any(body.get("stream") for body in a.bodies + b.bodies):
            await asyncio.sleep(0.01)
        failing = b if a.bodies else a  # the other engine, the one with room, takes the next stream
        failing.error_event_after = 2
        status, payload = await post(base, body)
        metrics = await metrics_of(base)
        await holder
    assert status == 200 and text_of(payload).startswith("".join(WORDS[:2]))  # no error event either
    assert payload.endswith(b"data: [DONE]\n\n")
    assert 'pdserve_decode_switches_total{kind="resumed"} 1.0' in metrics


async def test_a_resumed_chat_stream_reads_as_one_message() -> None:
    prefill, a, b = FakeEngine(), FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [a, b]) as base:
        a.break_stream_after = b.break_stream_after = 3
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        status, payload = await post(base, body, path="/v1/chat/completions")
    roles = payload.count(b'"role"')
    assert status == 200 and roles == 1  # the second engine's opening role event was dropped
    resumed = [body for body in a.bodies + b.bodies if len(body["messages"]) == 2]
    assert resumed[0]["messages"][-1] == {"role": "assistant", "content": "".join(WORDS[:3])}
    assert resumed[0]["continue_final_message"] is True


async def test_a_seeded_stream_is_not_resumed_but_ends_with_one_error_event() -> None:
    prefill, a, b = FakeEngine(), FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [a, b]) as base:
        a.break_stream_after = b.break_stream_after = 2
        status, payload = await post(base, {"model": MODEL, "prompt": "hi", "stream": True, "seed": 7})
    assert status == 200 and payload.count(b"decode_stream_failed") == 1 and payload.endswith(b"data: [DONE]\n\n")
    assert len(a.bodies + b.bodies) == 1


async def test_an_engine_failing_every_leg_is_ejected_while_its_health_still_answers() -> None:
    prefill, bad, good = FakeEngine(), FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [bad, good], eject_after_failures=2, eject_for_s=60) as base:
        bad.reject_status = 500
        for number in range(16):  # prompts of different homes: the bad engine is some of theirs
            status, _ = await post(base, {"model": MODEL, "prompt": f"hi {number}"})
            assert status == 200
        tries_when_ejected = len(bad.bodies)
        for number in range(16, 24):
            await post(base, {"model": MODEL, "prompt": f"hi {number}"})
        metrics = await metrics_of(base)
    assert tries_when_ejected == 2 and len(bad.bodies) == 2
    assert 'pdserve_engine_ejections_total{role="decode"} 1.0' in metrics


async def test_a_handoff_no_decode_leg_takes_is_given_back_to_the_prefill_engine() -> None:
    fake = FakeEngine()
    async with gateway_over([fake], [fake], max_in_flight_per_engine=1) as base:
        fake.decode_gate = asyncio.Event()
        holder = asyncio.create_task(post(base, {"model": MODEL, "prompt": "first"}))  # holds the decode slot
        while not any(body.get("prompt") == "first" and "kv_transfer_params" in body and
                      not body["kv_transfer_params"].get("do_remote_decode") for body in fake.bodies):
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(post(base, {"model": MODEL, "prompt": "second"}))
        while sum(body.get("prompt") == "second" for body in fake.bodies) < 1:  # its prefill is done
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # now waiting for a decode slot
        queued.cancel()  # the client goes away
        for _ in range(100):
            releases = [body for body in fake.bodies if body.get("model") == RELEASE_MODEL]
            if releases:
                break
            await asyncio.sleep(0.02)
        fake.decode_gate.set()
        await holder
        metrics = await metrics_of(base)
    assert releases and releases[0]["kv_transfer_params"] == {**KV_PARAMS, "remote_num_tokens": 1}  # the prefill reply's
    assert "pdserve_kv_releases_total 1.0" in metrics


async def test_a_request_past_its_deadline_is_aborted_on_the_engine() -> None:
    prefill, decode = FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [decode], request_timeout_s=0.5) as base:
        decode.token_delay_s = 0.2
        status, payload = await post(base, {"model": MODEL, "prompt": "hi", "stream": True})
        closed_early = await decode.closed_early_within()
    assert status == 200 and b"request_timeout" in payload and payload.endswith(b"data: [DONE]\n\n")
    assert closed_early == 1


async def test_a_decode_engine_that_never_starts_its_stream_times_out_at_the_first_token_deadline() -> None:
    prefill, decode = FakeEngine(), FakeEngine()
    async with gateway_over([prefill], [decode], first_token_timeout_s=0.3, leg_attempts=1) as base:
        decode.decode_gate = asyncio.Event()
        status, payload = await post(base, {"model": MODEL, "prompt": "hi", "stream": True})
        decode.decode_gate.set()  # lets the fake's handler end, so the server can stop
    assert status == 504 and json.loads(payload)["error"]["code"] == "decode_failed"
