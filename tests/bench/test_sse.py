"""Reading SSE streams: events split across reads, which events are tokens, usage and errors."""

from __future__ import annotations

from pdserve.bench.frames import Frames
from pdserve.bench.sse import DONE, EventSplitter, classify


def test_splitter_joins_an_event_cut_across_reads() -> None:
    splitter = EventSplitter()
    assert splitter.feed(b'data: {"a"') == []
    assert splitter.feed(b': 1}\n\ndata: [DONE]\n\n') == [b'{"a": 1}', DONE]


def test_completion_tokens_and_usage_are_read() -> None:
    frames = Frames(is_chat=False, model="m", request_id="r", created_s=0)
    token = classify(frames.token(" hi", is_last=False).removeprefix(b"data: ").strip())
    usage = classify(frames.usage(prompt_tokens=3, completion_tokens=7).removeprefix(b"data: ").strip())
    assert token.carries_token and token.completion_tokens is None
    assert not usage.carries_token and usage.completion_tokens == 7


def test_chat_role_announcement_is_not_a_token() -> None:
    frames = Frames(is_chat=True, model="m", request_id="r", created_s=0)
    assert not classify(frames.role().removeprefix(b"data: ").strip()).carries_token
    assert classify(frames.token("", is_last=False).removeprefix(b"data: ").strip()).carries_token


def test_error_event_is_reported() -> None:
    event = classify(b'{"error": {"message": "decode engine stream broke", "type": "server_error"}}')
    assert event.error == "decode engine stream broke" and not event.carries_token
