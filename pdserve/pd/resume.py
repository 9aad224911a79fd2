"""Continue a stream that broke mid-generation on another decode engine. Pure.

The new engine gets the original prompt plus the text already streamed, and generates the rest:
for a chat request the text becomes a final assistant message that the engine continues
(``continue_final_message``); for a completion it is appended to the prompt. Under the same
sampling settings that continuation follows the same distribution as the stream it replaces,
except where the request pins a sequence: a seed (the new engine's sampler would replay it from
the start), guided output or tool calls (their state lives in the broken engine). Those, and
anything the gateway cannot read back as text, are not resumed: the client gets an error event.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.protocol import SSE_EVENT_PREFIX

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
VLLM_DEFAULT_COMPLETION_MAX_TOKENS = 16  # what vLLM generates for a completion without max_tokens


@dataclass(frozen=True, slots=True)
class Sent:
    """What the client has received so far, read back from the relayed SSE bytes."""

    text: str
    tokens: int  # events that carried text: one per generated token as vLLM streams them
    is_finished: bool  # a finish_reason arrived: nothing is left to generate
    is_readable: bool  # False: tool calls, reasoning or unparseable events, so no continuation


def read_sent(chunks: Sequence[bytes], *, path: str) -> Sent:
    """Parse the SSE events relayed so far (only called once a stream breaks)."""
    text: list[str] = []
    tokens, is_finished = 0, False
    *whole_events, _cut_by_the_break = b"".join(chunks).split(b"\n\n")
    for event in whole_events:
        if not event.startswith(SSE_EVENT_PREFIX) or event == SSE_EVENT_PREFIX + b"[DONE]":
            continue  # keep-alive comments, the end marker
        try:
            choice = json.loads(event[len(SSE_EVENT_PREFIX):])["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            return Sent("".join(text), tokens, is_finished, is_readable=False)
        piece, is_readable = _piece(choice, path=path)
        if not is_readable:
            return Sent("".join(text), tokens, is_finished, is_readable=False)
        if piece:
            text.append(piece)
            tokens += 1
        is_finished = is_finished or bool(choice.get("finish_reason"))
    return Sent("".join(text), tokens, is_finished, is_readable=True)


def _piece(choice: dict[str, Any], *, path: str) -> tuple[str, bool]:
    """The text one event adds, and whether the event holds nothing else a continuation would lose."""
    if path == COMPLETIONS_PATH:
        piece = choice.get("text")
        return (piece, True) if isinstance(piece, str) else ("", False)
    delta = choice.get("delta") or {}
    if not isinstance(delta, dict) or delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
        return "", False
    piece = delta.get("content") or ""
    return (piece, True) if isinstance(piece, str) else ("", False)


def why_not_resumable(body: dict[str, Any], *, path: str) -> str | None:
    """The reason ``body`` cannot be continued elsewhere, or None. Checked once the stream breaks."""
    if body.get("seed") is not None:
        return "seeded sampling"
    if (body.get("response_format") or {}).get("type", "text") != "text":
        return "guided decoding"
    if body.get("tools"):
        return "tool calls"
    if path == COMPLETIONS_PATH and not isinstance(_one_prompt(body), str):
        return "a prompt of token ids"
    return None


def continuation_body(body: dict[str, Any], sent: Sent, *, path: str) -> dict[str, Any]:
    """The request that makes another engine generate what the broken stream had left. Pure."""
    resumed = {**body, **shorter_limits(body, sent.tokens, path=path)}
    if path == COMPLETIONS_PATH:
        resumed["prompt"] = str(_one_prompt(body)) + sent.text
        resumed["echo"] = False  # the client has seen the prompt already, if it asked to
        return resumed
    messages = list(body["messages"])
    last = messages[-1]
    if body.get("continue_final_message") and last.get("role") == "assistant" and isinstance(last.get("content"), str):
        messages[-1] = {**last, "content": last["content"] + sent.text}
    else:
        messages.append({"role": "assistant", "content": sent.text})
    resumed.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
    return resumed


def _one_prompt(body: dict[str, Any]) -> Any:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return prompt


def shorter_limits(body: dict[str, Any], tokens_sent: int, *, path: str) -> dict[str, int]:
    """Token limits less what was sent, so the whole reply stays within what the client asked for."""
    limits: dict[str, int] = {}
    for field in ("max_tokens", "max_completion_tokens"):
        if body.get(field) is not None:
            limits[field] = max(int(body[field]) - tokens_sent, 1)
    if path == COMPLETIONS_PATH and "max_tokens" not in limits:
        limits["max_tokens"] = max(VLLM_DEFAULT_COMPLETION_MAX_TOKENS - tokens_sent, 1)
    if body.get("min_tokens"):
        limits["min_tokens"] = max(int(body["min_tokens"]) - tokens_sent, 0)
    return limits


def drop_role_events(chunk: bytes) -> bytes:
    """The first bytes of a resumed chat stream without its opening role-only event: the client
    had that event from the first engine, and a second one would start a new message."""
    events = chunk.split(b"\n\n")
    kept = [event for event in events if not _is_role_only(event)]
    return b"\n\n".join(kept)


def _is_role_only(event: bytes) -> bool:
    if not event.startswith(SSE_EVENT_PREFIX) or b'"role"' not in event:
        return False
    try:
        delta = json.loads(event[len(SSE_EVENT_PREFIX):])["choices"][0]["delta"]
    except (ValueError, KeyError, IndexError, TypeError):
        return False
    return isinstance(delta, dict) and not delta.get("content") and set(delta) <= {"role", "content"}
