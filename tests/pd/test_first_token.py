"""pd/first_token.py's pure parts: which requests qualify, the first token as the client's request ends it, usage."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from pdserve.pd import first_token
from pdserve.pd.first_token import FirstToken
from pdserve.pd.kv import KVTransferParams

COMPLETIONS = "/v1/completions"
FIRST = FirstToken(token_id=7, text=" the", finish_reason="length", stop_reason=None, prompt_token_ids=(1, 2, 3),
                   reply_id="cmpl-a", created=1, model="m")


@pytest.mark.parametrize("extra", [{}, {"stop": []}, {"echo": False}, {"presence_penalty": 0.0},
                                   {"stream_options": {"include_usage": True}}, {"temperature": 0.7, "top_p": 0.9}])
def test_a_plain_streamed_completion_qualifies(extra: dict[str, Any]) -> None:
    assert first_token.applies({"prompt": "a", "stream": True, **extra}, path=COMPLETIONS, is_stream=True)


@pytest.mark.parametrize("extra", [{"stop": ["."]}, {"seed": 0}, {"logprobs": 0}, {"echo": True},
                                   {"frequency_penalty": 0.5}, {"min_tokens": 2}, {"return_token_ids": True},
                                   {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}])
def test_fields_whose_effect_spans_the_first_two_tokens_keep_the_first_token_on_the_decode_engine(
        extra: dict[str, Any]) -> None:
    assert not first_token.applies({"prompt": "a", "stream": True, **extra}, path=COMPLETIONS, is_stream=True)


def test_chat_and_whole_replies_do_not_qualify() -> None:
    assert not first_token.applies({"messages": []}, path="/v1/chat/completions", is_stream=True)
    assert not first_token.applies({"prompt": "a"}, path=COMPLETIONS, is_stream=False)


@pytest.mark.parametrize(("body", "finish_reason"), [({"max_tokens": 5}, None), ({}, None),  # vLLM's default: 16
                                                     ({"max_tokens": 1}, "length")])
def test_the_prefill_legs_own_one_token_limit_is_no_finish_unless_the_client_asked_for_one(
        body: dict[str, Any], finish_reason: str | None) -> None:
    assert first_token.for_client(body, FIRST, max_model_len=None).finish_reason == finish_reason
    assert first_token.for_client(body, replace(FIRST, finish_reason="stop"),
                                  max_model_len=None).finish_reason == "stop"  # EOS


def test_a_prompt_leaving_room_for_one_token_only_ends_at_the_prefill_engines_token() -> None:
    """FIRST's prompt is 3 tokens: a context of 4 holds the prompt and that one token, as vLLM caps max_tokens."""
    assert first_token.for_client({"max_tokens": 5}, FIRST, max_model_len=4).finish_reason == "length"
    assert first_token.for_client({"max_tokens": 5}, FIRST, max_model_len=5).finish_reason is None


def test_the_decode_engines_usage_counts_the_first_token_as_output() -> None:
    usage = {"prompt_tokens": 4, "total_tokens": 9, "completion_tokens": 5}
    chunk = (b'data: {"id":"c","choices":[{"index":0,"text":"x"}]}\n\n'
             b'data: {"id":"c","choices":[],"usage":' + json.dumps(usage, separators=(",", ":")).encode() + b'}\n\n'
             b"data: [DONE]\n\n")
    counted = first_token.count_in_usage(chunk)
    first, usage_event, done = counted.split(b"\n\n")[:3]
    assert first == chunk.split(b"\n\n")[0] and done == b"data: [DONE]"
    assert json.loads(usage_event[6:])["usage"] == {"prompt_tokens": 3, "total_tokens": 9, "completion_tokens": 6}
    assert counted.endswith(b"\n\n")


def test_the_first_tokens_event_reads_as_vllms_stream_chunk() -> None:
    (event,) = [line for line in first_token.event(FIRST).split(b"\n\n") if line]
    message = json.loads(event.removeprefix(b"data: "))
    assert message == {"id": "cmpl-a", "object": "text_completion", "created": 1, "model": "m",
                       "choices": [{"index": 0, "text": " the", "logprobs": None, "finish_reason": "length",
                                    "stop_reason": None}]}


@pytest.mark.parametrize(("block_ids", "prompt_tokens", "mapped"), [
    ([[3, 4]], 33, [[3, 4, 4]]),  # vLLM 0.26's one list per group, the token needing a third block
    ([[3, 4]], 32, [[3, 4]]),  # room in the second block
    ([3, 4], 33, [3, 4, 4]),  # an older vLLM's flat list, kept flat
    ([[3, 4]], 16, None),  # one block would hold it: these blocks are not this prompt's
    ([[3, 4], [5, 6]], 32, None),  # several KV cache groups
])
def test_the_prefill_engines_blocks_map_onto_a_prompt_one_token_longer(
        block_ids: list[Any], prompt_tokens: int, mapped: list[Any] | None) -> None:
    kv = KVTransferParams(fields={"remote_block_ids": block_ids, "remote_engine_id": "p"}, prompt_tokens=prompt_tokens - 1,
                          block_size=16)
    fields = kv.fields_for_prompt(prompt_tokens)
    assert (None if fields is None else fields["remote_block_ids"]) == mapped
    assert fields is None or fields["remote_engine_id"] == "p"
    assert replace(kv, block_size=0).fields_for_prompt(prompt_tokens) is None  # the engine's block size not read yet
