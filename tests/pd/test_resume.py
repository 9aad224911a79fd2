"""Resuming a broken stream: what was sent, read back; the continuation request; what is refused."""

from __future__ import annotations

import json
from typing import Any

from pdserve.pd import resume

CHAT, COMPLETIONS = resume.CHAT_PATH, resume.COMPLETIONS_PATH


def events(*choices: dict[str, Any]) -> bytes:
    return b"".join(f"data: {json.dumps({'choices': [choice]})}\n\n".encode() for choice in choices)


def test_read_sent_joins_chat_deltas_and_counts_one_token_per_text_event() -> None:
    role = {"delta": {"role": "assistant", "content": ""}}
    stream = events(role, {"delta": {"content": "Hel"}}, {"delta": {"content": "lo"}})
    sent = resume.read_sent([stream[:50], stream[50:]], path=CHAT)  # TCP cuts events anywhere
    assert sent == resume.Sent(text="Hello", tokens=2, is_finished=False, is_readable=True)


def test_read_sent_ignores_a_partial_last_event_and_keep_alives() -> None:
    whole = events({"text": "a"}, {"text": "b"})
    sent = resume.read_sent([b": keep-alive\n\n", whole, b'data: {"choi'], path=COMPLETIONS)
    assert (sent.text, sent.tokens, sent.is_readable) == ("ab", 2, True)


def test_read_sent_marks_a_finished_stream_and_an_unreadable_one() -> None:
    finished = resume.read_sent([events({"text": "a", "finish_reason": "stop"})], path=COMPLETIONS)
    assert finished.is_finished
    tool_call = resume.read_sent([events({"delta": {"tool_calls": [{"index": 0}]}})], path=CHAT)
    assert not tool_call.is_readable


def test_chat_continuation_appends_the_text_as_an_assistant_message_to_continue() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}
    sent = resume.Sent(text="Hello there", tokens=2, is_finished=False, is_readable=True)
    resumed = resume.continuation_body(body, sent, path=CHAT)
    assert resumed["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"}]
    assert resumed["continue_final_message"] is True and resumed["add_generation_prompt"] is False
    assert resumed["max_tokens"] == 8 and body["max_tokens"] == 10 and len(body["messages"]) == 1


def test_chat_continuation_extends_a_final_assistant_message_the_client_asked_to_continue() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}],
            "continue_final_message": True, "add_generation_prompt": False}
    sent = resume.Sent(text=" one", tokens=1, is_finished=False, is_readable=True)
    resumed = resume.continuation_body(body, sent, path=CHAT)
    assert resumed["messages"][-1] == {"role": "assistant", "content": "Sure: one"} and len(resumed["messages"]) == 2


def test_completion_continuation_extends_the_prompt_and_keeps_vllm_default_length() -> None:
    body = {"model": "m", "prompt": ["Once"], "echo": True, "min_tokens": 3}
    resumed = resume.continuation_body(body, resume.Sent(" upon a", 2, False, True), path=COMPLETIONS)
    assert resumed["prompt"] == "Once upon a" and resumed["echo"] is False
    assert resumed["max_tokens"] == resume.VLLM_DEFAULT_COMPLETION_MAX_TOKENS - 2 and resumed["min_tokens"] == 1


def test_seeded_guided_tool_and_token_id_requests_are_not_resumed() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert resume.why_not_resumable(chat, path=CHAT) is None
    assert resume.why_not_resumable({**chat, "seed": 1}, path=CHAT) == "seeded sampling"
    assert resume.why_not_resumable({**chat, "response_format": {"type": "json_object"}}, path=CHAT) == "guided decoding"
    assert resume.why_not_resumable({**chat, "response_format": {"type": "text"}}, path=CHAT) is None
    assert resume.why_not_resumable({**chat, "tools": [{"type": "function"}]}, path=CHAT) == "tool calls"
    assert resume.why_not_resumable({"model": "m", "prompt": [1, 2]}, path=COMPLETIONS) == "a prompt of token ids"


def test_drop_role_events_keeps_everything_else() -> None:
    role = events({"delta": {"role": "assistant", "content": ""}})
    text = events({"delta": {"content": "x"}})
    assert resume.drop_role_events(role) == b""
    assert resume.drop_role_events(role + text) == text
    assert resume.drop_role_events(text) == text
