"""The synthetic upstream: its pace (TTFT, token rate) and both PD legs in vLLM's wire format."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import uvloop

from pdserve.bench import runner
from pdserve.bench.records import RequestRecord
from pdserve.bench.upstream import TOKEN_ID_BASE, Pace, Upstream, reply_text, serving_upstream, token_text
from pdserve.bench.workload import CHAT, COMPLETIONS, BenchRequest
from pdserve.gateway.model_card import pick_card
from pdserve.routing.load import parse_engine_load

PACE = Pace(ttft_s=0.05, tokens_per_s=200.0, handoff_s=0.0)


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    async with serving_upstream(PACE) as served:
        yield served


def streamed(path: str, **fields: object) -> BenchRequest:
    body = {"model": "m", "max_tokens": 21, "stream": True, "stream_options": {"include_usage": True}, **fields}
    return BenchRequest(path, body)


async def test_stream_keeps_the_set_ttft_and_token_rate(upstream: Upstream) -> None:
    url = upstream.url
    async with runner.new_session() as session:
        record = await runner.send(session, "up", url, streamed(COMPLETIONS, prompt="a b c"), timeout_s=10)
    assert record.error is None and record.output_tokens == 21 and len(record.token_times_s) == 21
    assert record.ttft_s is not None and PACE.ttft_s <= record.ttft_s < PACE.ttft_s + 0.04
    measured_rate = 20 / (record.token_times_s[-1] - record.token_times_s[0])
    assert measured_rate == pytest.approx(PACE.tokens_per_s, rel=0.2)


async def test_chat_stream_announces_the_role_then_carries_every_token(upstream: Upstream) -> None:
    url = upstream.url
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    async with aiohttp.ClientSession() as session, session.post(url + CHAT, json=body) as reply:
        events = (await reply.read()).decode().split("\n\n")
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert events[-2:] == ["data: [DONE]", ""]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks[1:]) == reply_text(5)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_prefill_leg_answers_json_with_kv_transfer_params(upstream: Upstream) -> None:
    url, counts = upstream.url, upstream.counts
    body = {"model": "m", "prompt": "one two three", "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True}}
    started_s = time.perf_counter()
    async with aiohttp.ClientSession() as session, session.post(url + COMPLETIONS, json=body) as reply:
        payload = await reply.json()
    assert time.perf_counter() - started_s >= PACE.ttft_s
    assert payload["kv_transfer_params"]["do_remote_prefill"] is True
    assert payload["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    assert counts.prefill == 1


async def test_prefill_leg_with_token_ids_answers_them_as_vllm_does(upstream: Upstream) -> None:
    body = {"model": "m", "prompt": "one two three", "max_tokens": 1, "stream": False, "return_token_ids": True,
            "kv_transfer_params": {"do_remote_decode": True}}
    async with aiohttp.ClientSession() as session, session.post(upstream.url + COMPLETIONS, json=body) as reply:
        payload = await reply.json()
    (choice,) = payload["choices"]
    assert (choice["text"], choice["token_ids"]) == (token_text(0), [TOKEN_ID_BASE])
    assert len(choice["prompt_token_ids"]) == 3 and payload["kv_transfer_params"]["remote_num_tokens"] == 3


async def test_chat_prefill_leg_answers_every_field_vllm_032_writes(upstream: Upstream) -> None:
    """vLLM 0.32's ChatCompletionResponse.model_dump(): nulls included, an empty tool_calls dropped."""
    body = {"model": "m", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 1,
            "stream": False, "return_token_ids": True, "kv_transfer_params": {"do_remote_decode": True}}
    async with aiohttp.ClientSession() as session, session.post(upstream.url + CHAT, json=body) as reply:
        payload = await reply.json()
    (choice,) = payload["choices"]
    assert choice["message"] == {"role": "assistant", "content": token_text(0), "refusal": None, "annotations": None,
                                 "audio": None, "function_call": None, "reasoning": None}
    assert set(choice) == {"index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids",
                           "routed_experts"} and choice["token_ids"] == [TOKEN_ID_BASE]
    assert set(payload) == {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                            "usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
                            "ec_transfer_params", "metrics"} and len(payload["prompt_token_ids"]) == 3
    assert set(payload["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
                                     "completion_tokens_details"}


async def test_decode_leg_after_the_prefill_engines_token_continues_from_the_second(upstream: Upstream) -> None:
    body = {"model": "m", "prompt": [100, 101, TOKEN_ID_BASE], "max_tokens": 4, "stream": True,
            "kv_transfer_params": {"do_remote_prefill": True}}
    async with aiohttp.ClientSession() as session, session.post(upstream.url + COMPLETIONS, json=body) as reply:
        events = (await reply.read()).decode().split("\n\n")
    texts = [json.loads(event.removeprefix("data: "))["choices"][0]["text"] for event in events[:-2]]
    assert "".join(texts) == reply_text(5).removeprefix(token_text(0))


async def test_metrics_give_the_block_size_the_gateway_reads(upstream: Upstream) -> None:
    async with aiohttp.ClientSession() as session, session.get(upstream.url + "/metrics") as reply:
        text = await reply.text()
    assert reply.status == 200 and parse_engine_load(text, read_s=0.0).block_size == 16


async def test_models_give_a_vllm_card_with_the_context_length(upstream: Upstream) -> None:
    async with aiohttp.ClientSession() as session, session.get(upstream.url + "/v1/models") as reply:
        listing = await reply.json()
    card = pick_card(listing, "served")
    assert reply.status == 200 and card is not None
    assert card["id"] == "served" and card["owned_by"] == "vllm" and card["max_model_len"] > 4096


async def test_decode_leg_skips_the_prefill_time(upstream: Upstream) -> None:
    url, counts = upstream.url, upstream.counts
    request = streamed(COMPLETIONS, prompt="x", kv_transfer_params={"do_remote_prefill": True})
    async with runner.new_session() as session:
        record = await runner.send(session, "up", url, request, timeout_s=10)
    assert record.error is None and record.ttft_s is not None and record.ttft_s < PACE.ttft_s
    assert counts.decode == 1 and counts.whole == 0


def test_upstream_serves_under_uvloop_as_the_cli_runs_it() -> None:
    async def one_stream() -> RequestRecord:
        async with serving_upstream(PACE) as served, runner.new_session() as session:
            return await runner.send(session, "up", served.url, streamed(COMPLETIONS, prompt="x"), timeout_s=10)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop:
        record = loop.run(one_stream())
    assert record.error is None and record.output_tokens == 21
