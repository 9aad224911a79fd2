"""The prefill engine's token as the first token (pd/first_token.py), over real HTTP against fake engines.

The same path against real vLLM engines, token for token against one engine alone:
tests/e2e/test_serving.py::test_a_streamed_completion_starts_with_the_prefill_engines_token_and_matches_local.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from pdserve.gateway.client_reply import ClientTransport
from pdserve.pd.decode import RELEASE_MODEL
from pdserve_vllm import RESTORE_LAST_KEY, WHOLE_PROMPT_KEY
from tests.conftest import metric
from tests.fake_engine import FIRST_TOKEN_ID, KV_PARAMS, WORDS, FakeEngine
from tests.gateway.test_app import MODEL, post
from tests.gateway.test_faults import gateway_over, metrics_of, text_of
from tests.routing.test_load import vllm_load_metrics

# The fake prefill reply holds two blocks (KV_PARAMS) and these engines say 16 tokens per block.
PROMPT_FILLING_TWO_BLOCKS = list(range(1000, 1032))  # the first token needs a third block
PROMPT_WITH_ROOM = list(range(1000, 1020))  # the first token fits in the second block


def engines(**decode_knobs: Any) -> tuple[FakeEngine, FakeEngine]:
    """A prefill engine and a decode engine that continues after the prefill's token (WORDS[0])."""
    prefill = FakeEngine(metrics_text=vllm_load_metrics())
    decode = FakeEngine(metrics_text=vllm_load_metrics(), words=WORDS[1:], **decode_knobs)
    return prefill, decode


def streamed(prompt: Any, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 5, "stream": True, **fields}


def events(payload: bytes) -> list[dict[str, Any]]:
    return [json.loads(event[6:]) for event in payload.decode().split("\n\n") if event.startswith("data: {")]


async def settled(base: str) -> str:
    """The gateway once it has read the engines' block size (kv_scrape_interval_s 0.05)."""
    await asyncio.sleep(0.3)
    return base


async def test_the_client_gets_the_prefill_engines_token_first_and_the_decode_engine_continues_after_it() -> None:
    prefill, decode = engines()
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05) as base:
        status, payload = await post(await settled(base), streamed(PROMPT_FILLING_TWO_BLOCKS),
                                     headers={"X-Request-Id": "r1"})
        metrics = await metrics_of(base)
    assert status == 200 and text_of(payload) == "".join(WORDS) and payload.endswith(b"data: [DONE]\n\n")
    first = events(payload)[0]
    assert first["id"] == "cmpl-r1" and first["object"] == "text_completion" and first["model"] == MODEL
    assert first["choices"][0]["text"] == WORDS[0] and first["choices"][0]["finish_reason"] is None
    (prefill_body,) = prefill.bodies
    assert prefill_body["return_token_ids"] is True
    (decode_body,) = decode.bodies
    assert decode_body["prompt"] == [*PROMPT_FILLING_TWO_BLOCKS, FIRST_TOKEN_ID] and decode_body["max_tokens"] == 4
    # 33 tokens need a third block: the last remote one is named twice (the recomputed slot is the only one used).
    assert decode_body["kv_transfer_params"]["remote_block_ids"] == [3, 4, 4]
    assert 'pdserve_first_tokens_total{reason="eligible",route="/v1/completions",source="prefill"} 1.0' in metrics


async def test_blocks_are_passed_as_they_are_when_the_first_token_fits_and_refused_when_they_do_not_match() -> None:
    prefill, decode = engines()
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05) as base:
        await settled(base)
        _, fits = await post(base, streamed(PROMPT_WITH_ROOM))
        _, mismatched = await post(base, streamed(list(range(1000, 1010))))  # 11 tokens fill one block, not two
    assert text_of(fits) == "".join(WORDS)
    with_room, mismatch = decode.bodies
    assert with_room["kv_transfer_params"]["remote_block_ids"] == KV_PARAMS["remote_block_ids"]
    # Blocks the gateway cannot map: the decode engine gets the client's request and samples the first token itself.
    assert mismatch["prompt"] == list(range(1000, 1010)) and mismatch["max_tokens"] == 5
    assert text_of(mismatched) == "".join(WORDS[1:])  # (this fake decode engine always continues)


async def test_a_one_token_reply_comes_from_the_prefill_engine_alone_and_its_handoff_is_given_back() -> None:
    prefill, decode = engines()
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05) as base:
        status, payload = await post(await settled(base), streamed(
            PROMPT_WITH_ROOM, max_tokens=1, stream_options={"include_usage": True}))
        for _ in range(100):
            if decode.bodies:
                break
            await asyncio.sleep(0.02)
    assert status == 200 and payload.endswith(b"data: [DONE]\n\n")
    answer, usage = events(payload)
    assert answer["choices"][0] | {"text": WORDS[0], "finish_reason": "length"} == answer["choices"][0]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 20, "total_tokens": 21, "completion_tokens": 1}
    (release,) = decode.bodies  # no decode leg: only the handoff given back
    assert release["model"] == RELEASE_MODEL


async def test_a_prompt_one_token_short_of_the_context_ends_at_the_prefill_engines_token() -> None:
    """The fake's context is 2,048 tokens (its card): 2,047 leave room for the prefill engine's token only,
    where one vLLM engine caps max_tokens and ends ("length"); a decode engine would refuse the 2,048."""
    prefill, decode = engines()
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05) as base:
        status, payload = await post(await settled(base), streamed(list(range(2047))))
        for _ in range(100):
            if decode.bodies:
                break
            await asyncio.sleep(0.02)
    assert status == 200 and payload.endswith(b"data: [DONE]\n\n")
    (answer,) = events(payload)
    assert answer["choices"][0] | {"text": WORDS[0], "finish_reason": "length"} == answer["choices"][0]
    assert [body["model"] for body in decode.bodies] == [RELEASE_MODEL]  # no decode leg: the handoff given back


async def test_the_decode_engine_computes_the_first_token_where_the_prefill_engine_did_not_compute_the_whole_prompt() -> None:
    prefill, decode = engines()
    prefill.prefill_stops_short = 1  # a hybrid model's prefill engine leaves the last prompt token to decode
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05) as base:
        _, payload = await post(await settled(base), streamed(PROMPT_WITH_ROOM))
    assert events(payload)[0]["choices"][0]["text"] == WORDS[1]  # the decode engine's first word
    assert decode.bodies[0]["prompt"] == PROMPT_WITH_ROOM


async def test_a_hybrids_prefill_engine_asked_for_the_whole_prompt_leads_and_its_blocks_pass_as_they_are() -> None:
    prefill, decode = engines()
    prefill.prefill_stops_short, prefill.keeps_whole_prompt = 1, True  # pdserve_vllm.hybrid_connector's engine
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05) as base:
        _, payload = await post(await settled(base), streamed(PROMPT_FILLING_TWO_BLOCKS))
        await post(base, streamed(PROMPT_FILLING_TWO_BLOCKS, stop=["zz"]))  # a decode engine given the token as output
        metrics = await metrics_of(base)
    assert events(payload)[0]["choices"][0]["text"] == WORDS[0] and text_of(payload) == "".join(WORDS)
    asked, forced = prefill.bodies
    assert asked["kv_transfer_params"][WHOLE_PROMPT_KEY] is True and WHOLE_PROMPT_KEY not in forced["kv_transfer_params"]
    lead, short = decode.bodies
    assert lead["prompt"] == [*PROMPT_FILLING_TWO_BLOCKS, FIRST_TOKEN_ID]
    # The decode engine loads its prompt but the last token: the prompt's own blocks, none named twice.
    assert lead["kv_transfer_params"]["remote_block_ids"] == KV_PARAMS["remote_block_ids"]
    assert short["prompt"] == PROMPT_FILLING_TWO_BLOCKS  # vLLM's own handoff, a token short: the decode engine's token
    assert 'pdserve_first_tokens_total{reason="eligible",route="/v1/completions",source="prefill"} 1.0' in metrics


async def test_a_prefill_engine_that_cuts_hybrid_prompts_short_though_asked_is_named_once(
        caplog: pytest.LogCaptureFixture) -> None:
    prefill, decode = engines()
    prefill.prefill_stops_short = 1  # vLLM's own connector
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05) as base:
        for _ in range(2):
            _, payload = await post(await settled(base), streamed(PROMPT_WITH_ROOM))
            assert events(payload)[0]["choices"][0]["text"] == WORDS[1]  # the decode engine's first word
    said = [record for record in caplog.records if "stops a hybrid model's prompts a token short" in record.message]
    assert len(said) == 1 and said[0].message.startswith("prefill engine http://127.0.0.1:")


async def test_requests_whose_output_would_change_keep_the_first_token_on_the_decode_engine() -> None:
    prefill, decode = engines()
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05) as base:
        await settled(base)
        for body in (streamed(PROMPT_WITH_ROOM, stop=["."]), streamed(PROMPT_WITH_ROOM, seed=0),
                     {**streamed(PROMPT_WITH_ROOM), "stream": False},
                     {**streamed(PROMPT_WITH_ROOM, return_token_ids=True), "stream": False},
                     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            status, _ = await post(base, body, path=path)
            assert status == 200
    assert sum("return_token_ids" in body for body in prefill.bodies) == 1  # the client's own
    assert all("kv_transfer_params" in body and body.get("prompt", PROMPT_WITH_ROOM) == PROMPT_WITH_ROOM
               for body in decode.bodies)


async def test_a_decode_engine_failing_after_the_first_token_hands_the_rest_to_another_whole() -> None:
    prefill, broken = engines(break_stream_after=0)
    _, healthy = engines()
    async with gateway_over([prefill], [broken, healthy], kv_scrape_interval_s=0.05) as base:
        await settled(base)
        for offset in range(16):  # prompts of different homes, until one meets the broken engine
            prompt = [token + offset for token in PROMPT_WITH_ROOM]
            status, payload = await post(base, streamed(prompt))
            assert status == 200 and text_of(payload) == "".join(WORDS)
            if broken.bodies:
                break
    moved = [body for body in healthy.bodies if "kv_transfer_params" not in body]
    salt = broken.bodies[0]["cache_salt"]  # the tenant's, on every leg it takes (gateway/tenants.py)
    assert moved == [{**streamed([*prompt, FIRST_TOKEN_ID]), "max_tokens": 4, "cache_salt": salt}]


@asynccontextmanager
async def held_decode(**gateway: Any) -> AsyncIterator[tuple[str, FakeEngine, asyncio.Event]]:
    """A settled gateway over engines() whose decode engine holds each request, headers and all,
    until the event is set (the gateway's warm-up went through first); yields its URL too."""
    gate = asyncio.Event()
    gate.set()
    prefill, decode = engines(decode_gate=gate)
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05, **gateway) as base:
        await settled(base)
        gate.clear()
        try:
            yield base, decode, gate
        finally:
            gate.set()  # a request still held would keep the engine from shutting down


async def test_the_first_token_reaches_the_client_before_the_decode_engine_answers() -> None:
    async with held_decode() as (base, decode, gate), aiohttp.ClientSession() as session, \
            session.post(base + "/v1/completions", json=streamed(PROMPT_WITH_ROOM)) as reply:
        first = await asyncio.wait_for(reply.content.readuntil(b"\n\n"), 5.0)
        held = list(decode.bodies)  # the decode engine has the request and has not answered yet
        gate.set()
        rest = await reply.read()
    assert reply.status == 200 and events(first)[0]["choices"][0]["text"] == WORDS[0]
    assert len(held) == 1 and held[0]["prompt"] == [*PROMPT_WITH_ROOM, FIRST_TOKEN_ID]
    assert text_of(first + rest) == "".join(WORDS) and rest.endswith(b"data: [DONE]\n\n")


async def test_no_decode_engine_taking_the_request_after_the_first_token_ends_the_stream_with_an_error_event() -> None:
    prefill, decode = engines()
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05) as base:
        await settled(base)
        decode.reject_status = 500  # every decode leg fails (a 5xx: not the request's fault)
        status, payload = await post(base, streamed(PROMPT_WITH_ROOM), headers={"X-Request-Id": "r9"})
        metrics = await metrics_of(base)
    answer, failure = events(payload)
    assert status == 200 and answer["choices"][0]["text"] == WORDS[0] and payload.endswith(b"data: [DONE]\n\n")
    assert failure["error"]["code"] == "decode_stream_failed" and "r9" in failure["error"]["message"]
    assert "127.0.0.1" not in failure["error"]["message"]
    assert 'pdserve_leg_failures_total{role="decode"}' in metrics


async def test_a_full_decode_engine_refuses_with_429_before_the_first_token() -> None:
    async with held_decode(max_in_flight_per_engine=1, max_queued=0) as (base, decode, gate):
        holding = asyncio.create_task(post(base, streamed(PROMPT_WITH_ROOM)))
        for _ in range(250):  # until the first request holds the decode engine's one slot
            if decode.bodies:
                break
            await asyncio.sleep(0.02)
        status, payload = await post(base, streamed(PROMPT_WITH_ROOM))
        gate.set()
        held_status, _ = await holding
    assert status == 429 and json.loads(payload)["error"]["code"] == "overloaded", payload
    # The refused request's handoff is given back through the decode engine (orchestrator.py, fault 4).
    assert held_status == 200 and [body["model"] for body in decode.bodies] == [MODEL, RELEASE_MODEL]


async def test_a_client_leaving_after_the_first_token_frees_the_decode_engines_slot() -> None:
    async with held_decode() as (base, decode, gate):
        async with aiohttp.ClientSession() as session, \
                session.post(base + "/v1/completions", json=streamed(PROMPT_WITH_ROOM)) as reply:
            await asyncio.wait_for(reply.content.readuntil(b"\n\n"), 5.0)
            held = len(decode.bodies)
            reply.close()  # gone while the decode engine still holds its answer
        gate.set()
        legs = ""
        for _ in range(250):
            legs = "\n".join(line for line in (await metrics_of(base)).splitlines()
                             if line.startswith("pdserve_engine_legs_in_flight{") and 'role="decode"' in line)
            if legs.endswith(" 0.0"):
                break
            await asyncio.sleep(0.02)
        status, payload = await post(base, streamed(PROMPT_WITH_ROOM))  # the engine serves the next one
    assert held == 1 and legs.endswith(" 0.0"), legs
    assert status == 200 and text_of(payload) == "".join(WORDS)


async def test_the_response_head_waits_for_the_prefill_engines_token_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lead is in hand when the reply starts: the head goes out with it (ClientTransport.hold);
    without one, the head goes at once, as the decode engine may take long for its first token."""
    held: list[bool] = []
    monkeypatch.setattr(ClientTransport, "hold", lambda self: held.append(True))
    prefill, decode = engines()
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05) as base:
        await settled(base)
        _, with_lead = await post(base, streamed(PROMPT_WITH_ROOM))
        assert held == [True]
        _, without_lead = await post(base, streamed(list(range(1000, 1010))))  # blocks it cannot map: no lead
    assert held == [True]
    assert text_of(with_lead) == "".join(WORDS) and text_of(without_lead) == "".join(WORDS[1:])


def streamed_chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "say hello"}], "max_tokens": 5, "stream": True,
            **fields}


def chat_first_tokens(metrics: str, reason: str) -> float:
    """pdserve_first_tokens_total of streamed chat for ``reason`` in a /metrics page (the gateway's warm-up chat
    is counted too, so tests compare two pages)."""
    source = "prefill" if reason == "eligible" else "decode"
    return metric(metrics, f'pdserve_first_tokens_total{{reason="{reason}",route="/v1/chat/completions",source="{source}"}}')


def chat_engines() -> tuple[FakeEngine, FakeEngine]:
    """A prefill engine, and a decode engine that writes the whole reply: given the prefill's token as its first
    output (pdserve_vllm's logits processor), a real one writes that token's role and content events again."""
    prefill = FakeEngine(metrics_text=vllm_load_metrics())
    return prefill, FakeEngine(metrics_text=vllm_load_metrics())


async def test_a_streamed_chat_gets_the_prefill_engines_token_first_and_the_decode_engines_echo_of_it_is_dropped() -> None:
    prefill, decode = chat_engines()
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05,
                            decode_pool={"first_token_processor": True}) as base:
        before = await metrics_of(await settled(base))
        status, payload = await post(base, streamed_chat(), path="/v1/chat/completions", headers={"X-Request-Id": "r1"})
        metrics = await metrics_of(base)
    assert status == 200 and text_of(payload) == "".join(WORDS) and payload.endswith(b"data: [DONE]\n\n")
    role, first, *rest = events(payload)
    assert role["id"] == first["id"] == "chatcmpl-r1" and role["object"] == "chat.completion.chunk"
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["delta"] == {"content": WORDS[0]}  # the prefill engine's, sent before the decode leg's
    assert [event["choices"][0]["delta"] for event in rest] == [{"content": word} for word in WORDS[1:]]
    (prefill_body,) = prefill.bodies
    assert prefill_body["return_token_ids"] is True and prefill_body["messages"] == streamed_chat()["messages"]
    (decode_body,) = decode.bodies
    assert decode_body["vllm_xargs"] == {"pdserve_first_token": FIRST_TOKEN_ID}
    assert decode_body["messages"] == streamed_chat()["messages"] and decode_body["max_tokens"] == 5
    assert decode_body["kv_transfer_params"]["remote_block_ids"] == KV_PARAMS["remote_block_ids"]
    assert chat_first_tokens(metrics, "eligible") - chat_first_tokens(before, "eligible") == 1


async def hybrid_chat(*, keeps_whole_prompt: bool, **prefill_settings: Any
                      ) -> tuple[int, bytes, tuple[str, str], FakeEngine, FakeEngine]:
    """A streamed chat through a hybrid's prefill engine (vLLM's connector stops the prompt a token short) that keeps
    the whole prompt where asked (pdserve_vllm.hybrid_connector's), or not: status, payload, the gateway's metrics
    before and after, the two engines."""
    prefill = FakeEngine(metrics_text=vllm_load_metrics(), prefill_stops_short=1, keeps_whole_prompt=keeps_whole_prompt,
                         **prefill_settings)
    decode = FakeEngine(metrics_text=vllm_load_metrics())
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05,
                            decode_pool={"first_token_processor": True, "extra_args": PARSERS}) as base:
        before = await metrics_of(await settled(base))
        status, payload = await post(base, streamed_chat(), path="/v1/chat/completions")
        metrics = await metrics_of(base)
    return status, payload, (before, metrics), prefill, decode


async def test_a_hybrids_chat_leads_with_the_prefill_engines_token_and_its_decode_engine_undoes_the_last_tokens_recompute(
        ) -> None:
    status, payload, (before, metrics), prefill, decode = await hybrid_chat(keeps_whole_prompt=True)
    assert status == 200 and text_of(payload) == "".join(WORDS)
    assert events(payload)[1]["choices"][0]["delta"] == {"content": WORDS[0]}  # the prefill engine's token
    (prefill_body,) = prefill.bodies
    assert prefill_body["kv_transfer_params"][WHOLE_PROMPT_KEY] is prefill_body["kv_transfer_params"][RESTORE_LAST_KEY] is True
    (decode_body,) = decode.bodies
    assert decode_body["vllm_xargs"] == {"pdserve_first_token": FIRST_TOKEN_ID}
    handoff = decode_body["kv_transfer_params"]
    assert handoff["remote_block_ids"] == KV_PARAMS["remote_block_ids"] and handoff[RESTORE_LAST_KEY] is True
    assert chat_first_tokens(metrics, "eligible") - chat_first_tokens(before, "eligible") == 1


async def test_a_hybrids_chat_whose_prefill_engine_stopped_short_takes_vllms_own_handoff_and_the_decode_engines_token(
        ) -> None:
    status, payload, (before, metrics), _, decode = await hybrid_chat(keeps_whole_prompt=False)
    assert status == 200 and payload.endswith(b"data: [DONE]\n\n")
    (decode_body,) = decode.bodies
    assert "vllm_xargs" not in decode_body and RESTORE_LAST_KEY not in decode_body["kv_transfer_params"]
    reason = "prefill_stopped_short"
    assert chat_first_tokens(metrics, reason) - chat_first_tokens(before, reason) == 1


async def test_a_hybrids_chat_whose_first_delta_the_prefill_reply_does_not_tell_gets_that_token_from_the_decode_engine(
        ) -> None:
    """The whole-prompt handoff lines up with no decode leg but one given the token as output: the decode engine writes
    it as its own first token, which the client then gets from that engine."""
    message = {"role": "assistant", "content": "<", "reasoning": None, "tool_calls": []}  # a tag's start?
    status, payload, (before, metrics), _, decode = await hybrid_chat(keeps_whole_prompt=True, first_message=message)
    assert status == 200 and text_of(payload) == "".join(WORDS)
    (decode_body,) = decode.bodies
    assert decode_body["vllm_xargs"] == {"pdserve_first_token": FIRST_TOKEN_ID}
    assert decode_body["kv_transfer_params"][RESTORE_LAST_KEY] is True
    assert chat_first_tokens(metrics, "parser_unsure") - chat_first_tokens(before, "parser_unsure") == 1


async def test_a_chat_stays_on_the_decode_engines_token_where_that_engine_cannot_be_given_one_and_says_why() -> None:
    prefill, decode = chat_engines()
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05) as base:  # engines at urls: unknown
        before = await metrics_of(await settled(base))
        _, payload = await post(base, streamed_chat(), path="/v1/chat/completions")
        whole_status, _ = await post(base, {**streamed_chat(), "stream": False}, path="/v1/chat/completions")
        metrics = await metrics_of(base)
    assert text_of(payload) == "".join(WORDS) and "vllm_xargs" not in decode.bodies[0] and whole_status == 200
    assert "return_token_ids" not in prefill.bodies[0]
    for reason in ("decode_cannot_force", "not_streamed"):
        assert chat_first_tokens(metrics, reason) - chat_first_tokens(before, reason) == 1, reason


async def test_a_chat_whose_decode_engine_fails_after_the_lead_moves_whole_and_the_new_engines_echo_is_dropped_too() -> None:
    prefill = FakeEngine(metrics_text=vllm_load_metrics())
    broken = FakeEngine(metrics_text=vllm_load_metrics(), break_stream_after=0)  # its role event, then nothing
    healthy = FakeEngine(metrics_text=vllm_load_metrics())
    async with gateway_over([prefill], [broken, healthy], kv_scrape_interval_s=0.05,
                            decode_pool={"first_token_processor": True}) as base:
        await settled(base)
        for turn in range(16):  # conversations of different homes, until one meets the broken engine
            body = streamed_chat(messages=[{"role": "user", "content": f"say hello {turn}"}])
            status, payload = await post(base, body, path="/v1/chat/completions")
            assert status == 200 and text_of(payload) == "".join(WORDS), payload
            assert [event["choices"][0]["delta"].get("role") for event in events(payload)].count("assistant") == 1
            if broken.bodies:
                break
    moved = [sent for sent in healthy.bodies if "kv_transfer_params" not in sent]
    salt = broken.bodies[0]["cache_salt"]  # the tenant's, on every leg it takes (gateway/tenants.py)
    assert moved == [{**body, "cache_salt": salt, "vllm_xargs": {"pdserve_first_token": FIRST_TOKEN_ID}}]


PARSERS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
TAG = "<tool_call>"


async def test_a_chat_through_parsers_leads_with_the_parsers_delta_or_with_the_role_alone_for_a_held_tag() -> None:
    """pd/first_delta.py's reading of the prefill reply's message: reasoning goes out as the parser streams it; a
    tag the tool parser holds has no event, so the decode engine's role event alone is dropped."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    cases: list[tuple[dict[str, Any], list[dict[str, Any] | None], dict[str, Any]]] = [
             ({"role": "assistant", "content": None, "reasoning": WORDS[0], "tool_calls": []},
              [{"reasoning": word} for word in WORDS], {}),
             ({"role": "assistant", "content": TAG, "reasoning": None, "tool_calls": []},
              [None, *({"tool_calls": [{"index": 0, "function": {"arguments": word}}]} for word in WORDS[1:])],
              {"tools": tools})]
    for message, deltas, fields in cases:
        prefill = FakeEngine(metrics_text=vllm_load_metrics(), first_message=message)
        decode = FakeEngine(metrics_text=vllm_load_metrics(), chat_deltas=deltas)
        async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05,
                                decode_pool={"first_token_processor": True, "extra_args": PARSERS}) as base:
            before = await metrics_of(await settled(base))
            status, payload = await post(base, streamed_chat(**fields), path="/v1/chat/completions")
            metrics = await metrics_of(base)
        assert status == 200 and decode.bodies[0]["vllm_xargs"] == {"pdserve_first_token": FIRST_TOKEN_ID}
        role, *rest = events(payload)
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [event["choices"][0]["delta"] for event in rest] == [delta for delta in deltas if delta is not None]
        assert chat_first_tokens(metrics, "eligible") - chat_first_tokens(before, "eligible") == 1


async def test_a_chat_through_parsers_whose_first_token_the_prefill_reply_does_not_tell_stays_on_the_decode_engine(
        ) -> None:
    message: dict[str, Any] = {"role": "assistant", "content": "<", "reasoning": None, "tool_calls": []}  # a tag's start?
    prefill = FakeEngine(metrics_text=vllm_load_metrics(), first_message=message)
    decode = FakeEngine(metrics_text=vllm_load_metrics())
    async with gateway_over([prefill], [decode], kv_scrape_interval_s=0.05,
                            decode_pool={"first_token_processor": True, "extra_args": PARSERS}) as base:
        before = await metrics_of(await settled(base))
        _, payload = await post(base, streamed_chat(), path="/v1/chat/completions")
        _, stopped = await post(base, streamed_chat(stop=["x"]), path="/v1/chat/completions")
        metrics = await metrics_of(base)
    assert text_of(payload) == text_of(stopped) == "".join(WORDS) and "vllm_xargs" not in decode.bodies[0]
    for reason in ("parser_unsure", "chat_parser"):
        assert chat_first_tokens(metrics, reason) - chat_first_tokens(before, reason) == 1, reason
