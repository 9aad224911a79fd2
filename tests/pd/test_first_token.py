"""pd/first_token.py's pure parts: which requests qualify and how, reading the token, as the client's request ends it."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from pdserve.pd import first_token
from pdserve.pd.first_token import FirstToken, Reason
from pdserve.pd.kv import KVTransferParams
from pdserve_vllm import WHOLE_PROMPT_KEPT_KEY

COMPLETIONS = "/v1/completions"
FIRST = FirstToken(token_id=7, text=" the", finish_reason="length", stop_reason=None, prompt_tokens=3, prompt_token_ids=(1, 2, 3),
                   reply_id="cmpl-a", created=1, model="m")


CHAT = "/v1/chat/completions"


def why_not(body: dict[str, Any], *, path: str = COMPLETIONS, is_stream: bool = True, decode_forces: bool = True,
            parses_chat: bool = False) -> Reason | None:
    return first_token.why_not(body, path=path, is_stream=is_stream, decode_forces=decode_forces,
                               parses_chat=parses_chat)


@pytest.mark.parametrize("extra", [{}, {"stop": []}, {"echo": False}, {"presence_penalty": 0.0},
                                   {"stream_options": {"include_usage": True}}, {"temperature": 0.7, "top_p": 0.9}])
def test_a_plain_streamed_completion_qualifies_and_continues_after_the_token(extra: dict[str, Any]) -> None:
    body = {"prompt": "a", "stream": True, **extra}
    assert why_not(body, decode_forces=False) is None and not first_token.is_forced(body, path=COMPLETIONS)


@pytest.mark.parametrize("extra", [{"stop": ["."]}, {"seed": 0}, {"frequency_penalty": 0.5}, {"min_tokens": 2},
                                   {"presence_penalty": 0.1}, {"response_format": {"type": "json_object"}}])
def test_fields_whose_effect_spans_the_first_two_tokens_have_the_decode_engine_given_the_token_as_output(
        extra: dict[str, Any]) -> None:
    body = {"prompt": "a", "stream": True, **extra}
    assert why_not(body) is None and first_token.is_forced(body, path=COMPLETIONS)
    assert why_not(body, decode_forces=False) is Reason.DECODE_CANNOT_FORCE


@pytest.mark.parametrize(("extra", "reason"), [
    ({"logprobs": 0}, Reason.WITH_LOGPROBS), ({"echo": True}, Reason.WITH_ECHO), ({"n": 2}, Reason.WITH_N),
    ({"return_token_ids": True}, Reason.WITH_TOKEN_IDS),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, Reason.WITH_CONTINUOUS_USAGE)])
def test_fields_describing_the_first_token_keep_it_on_the_decode_engine(extra: dict[str, Any], reason: Reason) -> None:
    assert why_not({"prompt": "a", "stream": True, **extra}) is reason


def test_a_streamed_chat_qualifies_unless_its_stop_strings_go_through_a_parser_and_the_decode_engine_can_be_given_the_token() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert why_not(body, path=CHAT) is None and first_token.is_forced(body, path=CHAT)
    assert why_not({**body, "logprobs": False}, path=CHAT) is None  # a chat's logprobs is a flag
    assert why_not({**body, "logprobs": True}, path=CHAT) is Reason.WITH_LOGPROBS
    assert why_not(body, path=CHAT, parses_chat=True) is None  # the parser's delta is read after the prefill leg
    assert why_not({**body, "stop": ["x"]}, path=CHAT, parses_chat=True) is Reason.CHAT_PARSER
    assert why_not(body, path=CHAT, decode_forces=False) is Reason.DECODE_CANNOT_FORCE
    assert why_not(body, path=CHAT, is_stream=False) is Reason.NOT_STREAMED
    assert why_not(body, path="/v1/responses") is Reason.OTHER_ROUTE


@pytest.mark.parametrize(("body", "text"), [
    ({}, "ab."), ({"stop": "x"}, "ab."), ({"stop": ["xyz", "q"]}, "a"), ({"stop": ["toolong"]}, ""),
    ({"stop": ["xyz"], "include_stop_str_in_output": True}, "ab.")])
def test_with_stop_strings_the_first_tokens_text_is_held_back_as_vllms_detokenizer_holds_it(
        body: dict[str, Any], text: str) -> None:
    assert first_token.streamed_text(body, "ab.") == text


def test_a_chat_reply_is_read_with_its_prompt_counted_by_its_usage_and_a_hybrids_short_prefill_is_refused() -> None:
    reply = {"id": "chatcmpl-r", "created": 3, "model": "m", "prompt_token_ids": None, "usage": {"prompt_tokens": 2},
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "length",
                          "stop_reason": None, "token_ids": [9]}], "kv_transfer_params": {"remote_num_tokens": 2}}
    first = first_token.read(reply)
    assert isinstance(first, FirstToken) and (first.token_id, first.text, first.prompt_tokens) == (9, "Hi", 2)
    assert first_token.read({**reply, "kv_transfer_params": {"remote_num_tokens": 1}}) is Reason.PREFILL_STOPPED_SHORT
    assert first_token.read({**reply, "choices": [{}]}) is Reason.PREFILL_REPLY_UNREADABLE


@pytest.mark.parametrize(("body", "finish_reason"), [({"max_tokens": 5}, None), ({}, None),  # vLLM's default: 16
                                                     ({"max_tokens": 1}, "length")])
def test_the_prefill_legs_own_one_token_limit_is_no_finish_unless_the_client_asked_for_one(
        body: dict[str, Any], finish_reason: str | None) -> None:
    assert first_token.for_client(body, FIRST, path=COMPLETIONS, max_model_len=None).finish_reason == finish_reason
    assert first_token.for_client(body, replace(FIRST, finish_reason="stop"), path=COMPLETIONS,
                                  max_model_len=None).finish_reason == "stop"  # EOS
    assert first_token.for_client({}, FIRST, path=CHAT, max_model_len=None).finish_reason is None  # the context's


def test_a_prompt_leaving_room_for_one_token_only_ends_at_the_prefill_engines_token() -> None:
    """FIRST's prompt is 3 tokens: a context of 4 holds the prompt and that one token, as vLLM caps max_tokens."""
    assert first_token.for_client({"max_tokens": 5}, FIRST, path=COMPLETIONS, max_model_len=4).finish_reason == "length"
    assert first_token.for_client({"max_tokens": 5}, FIRST, path=COMPLETIONS, max_model_len=5).finish_reason is None


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


def test_a_hybrids_whole_prompt_handoff_maps_as_it_is_onto_the_prompt_plus_the_token_only() -> None:
    """The decode engine of a hybrid loads its prompt but the last token: the whole prefilled prompt, in its blocks."""
    fields = {"remote_block_ids": [[3, 4], [9]], "remote_num_tokens": 20, WHOLE_PROMPT_KEPT_KEY: True}
    kv = KVTransferParams(fields=fields, prompt_tokens=20, block_size=16)
    assert kv.is_whole_prompt and kv.fields_for_prompt(21) == fields
    assert kv.fields_for_prompt(20) is None and kv.fields_for_prompt(22) is None
    short = KVTransferParams(fields={**fields, WHOLE_PROMPT_KEPT_KEY: None}, prompt_tokens=20, block_size=16)
    assert not short.is_whole_prompt and short.fields_for_prompt(21) is None  # vLLM's handoff: several groups


@pytest.mark.parametrize("separator", [b":", b": "], ids=["vllm", "spaced"])
def test_a_chat_reply_is_parsed_without_its_prompt_ids_and_a_text_that_names_them_is_left_alone(
        separator: bytes) -> None:
    text = '"prompt_token_ids":[1]'  # a message that writes the key: escaped in JSON, so not it
    raw = json.dumps({"choices": [{"message": {"content": text}, "token_ids": [9]}], "usage": {"prompt_tokens": 3},
                      "prompt_token_ids": [1, 2, 3], "kv_transfer_params": {"remote_num_tokens": 3}},
                     separators=(",", separator.decode())).encode()

    reply = json.loads(first_token.without_chat_prompt_ids(raw))

    assert reply["prompt_token_ids"] is None and reply["choices"][0]["message"]["content"] == text
    assert reply["usage"] == {"prompt_tokens": 3} and reply["kv_transfer_params"] == {"remote_num_tokens": 3}
    assert first_token.without_chat_prompt_ids(b'{"prompt_token_ids":null}') == b'{"prompt_token_ids":null}'
