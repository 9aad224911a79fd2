"""The bytes vLLM's OpenAI server sends, for the synthetic upstream: SSE chunks, usage, whole replies.
Compact JSON, as vLLM writes its stream events (pydantic's ``model_dump_json``).

Each chunk is spliced from pre-encoded halves around the token's JSON string, so the upstream
spends microseconds per token and never competes with the gateway it is measuring. Pure.
"""

from __future__ import annotations

import json
from typing import Any

_NOT_LAST = b',"logprobs":null,"finish_reason":null'
_LAST = b',"logprobs":null,"finish_reason":"length"'


class Frames:
    """SSE chunks of one reply, in vLLM's shape for /v1/completions or /v1/chat/completions."""

    def __init__(self, *, is_chat: bool, model: str, request_id: str, created_s: int) -> None:
        self.is_chat, self.request_id = is_chat, request_id
        self._object = "chat.completion.chunk" if is_chat else "text_completion"
        self._id = ("chatcmpl-" if is_chat else "cmpl-") + request_id
        self._header = {"id": self._id, "object": self._object, "created": created_s, "model": model}
        opening = _compact(self._header)[:-1]
        self._before_text = b"data: " + opening + (
            b',"choices":[{"index":0,"delta":{"content":' if is_chat else b',"choices":[{"index":0,"text":'
        )
        self._after_text = b"}" if is_chat else b""
        self._stop_reason = b"" if is_chat else b',"stop_reason":null'

    def role(self) -> bytes:
        """Chat streams announce the assistant's role in a chunk of their own, before any token."""
        if not self.is_chat:
            return b""
        return _event(self._header | {"choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ]})

    def token(self, text: str, *, is_last: bool) -> bytes:
        return b"".join((
            self._before_text, json.dumps(text).encode(), self._after_text,
            _LAST if is_last else _NOT_LAST, self._stop_reason, b"}]}\n\n",
        ))

    def usage(self, *, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The final chunk of ``stream_options.include_usage``: no choices, just the counts."""
        return _event(self._header | {"choices": [], "usage": _usage(prompt_tokens, completion_tokens)})

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"

    def whole_reply(self, text: str, *, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """A non-streamed reply (``object`` without ``.chunk``)."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if self.is_chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice |= {"text": text, "stop_reason": None}
        return self._header | {
            "object": "chat.completion" if self.is_chat else "text_completion",
            "choices": [choice], "usage": _usage(prompt_tokens, completion_tokens),
        }


def prompt_token_ids(body: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids when it is given as ids; None for text."""
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else None


def prompt_tokens(body: dict[str, Any]) -> int:
    """A stand-in prompt length: words of the prompt or messages, or the token ids given."""
    if (ids := prompt_token_ids(body)) is not None:
        return len(ids)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return sum(len(str(part).split()) for part in prompt)
    if isinstance(prompt, str):
        return len(prompt.split())
    messages = body.get("messages") or []
    return sum(len(str(message.get("content") or "").split()) for message in messages if isinstance(message, dict))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + _compact(data) + b"\n\n"


def _compact(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()
