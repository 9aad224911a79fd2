"""The SSE events of the prefill engine's token, byte for byte as vLLM's server writes them for one engine. Pure.

vLLM 0.32 writes each event with pydantic's ``model_dump_json(exclude_unset=True)``: the fields its
serving code sets, None ones included, in the order its models declare them (completion/serving.py:403-442;
chat_completion/serving.py: the role event at 537-589, one event per output step at 757-829, the usage
event at 858-892). vLLM 0.26 (the GPU stage) writes the same events: its two stream generators differ
from 0.32's only under options pdserve's first token is not used with (logprobs, reasoning token counts in
usage, speculative decoding's per-request metrics) and in where an error finish is raised.
"""

from __future__ import annotations

from typing import Any

import pydantic_core

from pdserve.pd.first_token import FirstToken
from pdserve.pd.resume import CHAT_PATH
from pdserve.protocol import SSE_DONE, SSE_EVENT_PREFIX

RESPONSE_ROLE = "assistant"  # vLLM's --response-role default: the role of a reply to a generation prompt


def token_events(body: dict[str, Any], first: FirstToken, *, path: str, text: str) -> bytes:
    """The events one engine streams for its first output step, that step's ``text`` in them: a completion's
    one event; a chat's role event and then the token's: its content, or the delta its reasoning or
    tool-call parser writes (``first.delta``), none where that parser writes none (``first.is_held``)."""
    if path != CHAT_PATH:
        return sse(message(first, path=path, choices=[{"index": 0, "text": text, "logprobs": None,
                                                       "finish_reason": first.finish_reason,
                                                       "stop_reason": first.stop_reason,
                                                       "prompt_token_ids": None, "token_ids": None}]))
    role = message(first, path=path, choices=[{"index": 0, "delta": {"role": role_of(body), "content": ""},
                                               "logprobs": None, "finish_reason": None}],
                   prompt_token_ids=None, prompt_text=None)
    if first.is_held:
        return sse(role)
    delta = first.delta or {"content": text}
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": first.finish_reason}
    if first.finish_reason is not None:
        choice["stop_reason"] = first.stop_reason
    choice["token_ids"] = None
    return sse(role) + sse(message(first, path=path, choices=[choice]))


def role_of(body: dict[str, Any]) -> str:
    """The role vLLM opens a chat reply with (get_chat_request_role, chat_completion/serving.py:433)."""
    if body.get("add_generation_prompt", True):
        return RESPONSE_ROLE
    return str(body["messages"][-1]["role"])


def ending(body: dict[str, Any], first: FirstToken, *, path: str) -> bytes:
    """What follows the first token when it is the last: the usage event if asked, then [DONE]."""
    if not (body.get("stream_options") or {}).get("include_usage"):
        return SSE_DONE
    prompt_tokens = first.prompt_tokens
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + 1, "completion_tokens": 1}
    if first.prompt_tokens_details is not None:  # as the engine that computed this reply wrote it
        usage["prompt_tokens_details"] = first.prompt_tokens_details
    return sse(message(first, path=path, choices=[], usage=usage)) + SSE_DONE


def message(first: FirstToken, *, path: str, **fields: Any) -> dict[str, Any]:
    """A stream chunk of the prefill engine's reply (its id, as the decode engine's: both get the request id)."""
    kind = "chat.completion.chunk" if path == CHAT_PATH else "text_completion"
    return {"id": first.reply_id, "object": kind, "created": first.created, "model": first.model, **fields}


def sse(message: dict[str, Any]) -> bytes:
    return SSE_EVENT_PREFIX + pydantic_core.to_json(message) + b"\n\n"
