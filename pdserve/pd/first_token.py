"""The prefill engine's token goes to the client as the first token; the decode engine generates the rest. Pure.

A prefill leg samples one token (``max_tokens`` 1) that other PD proxies throw away (vLLM's example proxy;
Ray Serve LLM 2.58's PDDecodeServer, pd_server.py ``_prepare_decode_request``): the decode engine
pulls the prompt's KV cache, recomputes the last prompt token and samples the first token again, so the
client waits for the pull and a decode step before it sees anything. Here the prefill leg asks for token
ids (``return_token_ids``), the gateway streams its token at once, and the decode leg gets the prompt's
token ids plus that token: the decode engine pulls the prompt's KV, computes the one new position (the
step it spent recomputing the last prompt token) and continues from the second token. PD TTFT becomes
the prefill engine's (docs/benchmarks.md, section 8).

Stock vLLM decode engines take it: vLLM's NixlConnector claims the whole prompt (n + 1 tokens) as
remote, allocates blocks for it, reads the prefill engine's blocks into them and, its prompt being
"fully cached", recomputes the last position (the token added here) before sampling
(``get_num_new_matched_tokens``, ``_update_waiting_for_remote_kv``; vLLM 0.26 and 0.32). How the blocks
map onto that longer prompt is pd/kv.py's ``fields_for_prompt``.

Only where the output stays what one engine would produce: a streamed ``/v1/completions`` of one
attention-only model (a hybrid model's prefill engine stops one token short: ``remote_num_tokens`` < the
prompt), and none of the fields whose effect spans the first two tokens or needs the first token's
details (stop strings, penalties over output tokens, a seed, logprobs, echo, min_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pydantic_core

from pdserve.pd import resume
from pdserve.protocol import SSE_DONE, SSE_EVENT_PREFIX

# Request fields under which the decode engine would not continue as one engine does: the stop
# check and the penalties look only at output text and tokens (the first token is prompt for the
# decode engine), a seeded sampler would restart, and logprobs, echo and token ids describe the first
# token in the decode engine's own first event.
_NOT_WITH = ("stop", "presence_penalty", "frequency_penalty", "echo", "min_tokens", "return_token_ids")
_NOT_WITH_ANY = ("seed", "logprobs")  # a seed of 0 and logprobs 0 mean something
USAGE_MARK = b'"usage":{'  # vLLM's usage event, compact JSON (pydantic's model_dump_json)


def applies(body: dict[str, Any], *, path: str, is_stream: bool) -> bool:
    """Whether ``body`` may get its first token from the prefill engine. Checked once per request."""
    if not is_stream or path != resume.COMPLETIONS_PATH:
        return False
    if any(body.get(field) for field in _NOT_WITH) or any(body.get(field) is not None for field in _NOT_WITH_ANY):
        return False
    return not (body.get("stream_options") or {}).get("continuous_usage_stats")


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The prefill engine's token, as its reply gave it."""

    token_id: int
    text: str
    finish_reason: str | None  # set: this token ends the reply (a stop token, or max_tokens 1)
    stop_reason: int | str | None
    prompt_token_ids: tuple[int, ...]
    reply_id: str
    created: int
    model: str


def read(reply: dict[str, Any]) -> FirstToken | None:
    """The first token of a prefill reply asked with ``return_token_ids``; None when the reply lacks
    what is needed, or its engine computed less than the whole prompt (a hybrid model's)."""
    try:
        choice = reply["choices"][0]
        (token_id,) = choice["token_ids"]
        prompt = tuple(map(int, choice["prompt_token_ids"]))
        computed = reply["kv_transfer_params"].get("remote_num_tokens")
        first = FirstToken(token_id=int(token_id), text=str(choice.get("text") or ""),
                           finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"),
                           prompt_token_ids=prompt, reply_id=str(reply["id"]), created=int(reply["created"]),
                           model=str(reply["model"]))
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None
    if computed is not None and int(computed) < len(prompt):
        return None
    return first


def for_client(body: dict[str, Any], first: FirstToken, *, max_model_len: int | None) -> FirstToken:
    """``first`` as the client's request ends it: the prefill leg's own limit of one token is no
    finish unless the client asked for one token (``resume.shorter_limits`` leaves it 1 then) or the
    prompt left room in the context (``max_model_len``, None: unknown) for that one only: vLLM caps
    max_tokens at the context left (get_max_tokens, vLLM 0.26 and 0.32), so one engine ends there too."""
    if first.finish_reason != "length" or resume.shorter_limits(body, 0, path=resume.COMPLETIONS_PATH)["max_tokens"] <= 1:
        return first
    if max_model_len is not None and len(first.prompt_token_ids) + 1 >= max_model_len:
        return first
    return replace(first, finish_reason=None)


def event(first: FirstToken) -> bytes:
    """The SSE event of the first token, as vLLM's completion stream writes it."""
    return _sse(_message(first, choices=[{"index": 0, "text": first.text, "logprobs": None,
                                          "finish_reason": first.finish_reason, "stop_reason": first.stop_reason}]))


def ending(body: dict[str, Any], first: FirstToken) -> bytes:
    """What follows the first token when it is the last: the usage event if asked, then [DONE]."""
    if not (body.get("stream_options") or {}).get("include_usage"):
        return SSE_DONE
    prompt_tokens = len(first.prompt_token_ids)
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + 1, "completion_tokens": 1}
    return _sse(_message(first, choices=[], usage=usage)) + SSE_DONE


def _message(first: FirstToken, **fields: Any) -> dict[str, Any]:
    """A completion stream chunk of the prefill engine's reply."""
    return {"id": first.reply_id, "object": "text_completion", "created": first.created, "model": first.model,
            **fields}


@dataclass(frozen=True, slots=True)
class Lead:
    """The first token's event, and the request that continues after it on any decode engine."""

    event: bytes
    continuation: dict[str, Any]  # the decode leg's body without the KV handoff: that engine prefills


def continue_after(body: dict[str, Any], first: FirstToken, kv_fields: dict[str, Any]) -> tuple[dict[str, Any], Lead]:
    """The decode leg that continues after ``first`` with ``kv_fields`` (the prefill engine's handoff
    mapped to a prompt one token longer: ``KVTransferParams.fields_for_prompt``), and the lead."""
    continuation = {**body, **resume.shorter_limits(body, 1, path=resume.COMPLETIONS_PATH),
                    "prompt": [*first.prompt_token_ids, first.token_id]}
    return {**continuation, "kv_transfer_params": kv_fields}, Lead(event(first), continuation)


def count_in_usage(chunk: bytes) -> bytes:
    """The decode engine's usage event with the first token counted as output, not prompt."""
    events = chunk.split(b"\n\n")
    for index, raw in enumerate(events):
        if USAGE_MARK not in raw or not raw.startswith(SSE_EVENT_PREFIX):
            continue
        try:
            message = pydantic_core.from_json(raw[len(SSE_EVENT_PREFIX):])
            usage = message["usage"]
            usage["prompt_tokens"] -= 1
            usage["completion_tokens"] += 1
        except (ValueError, KeyError, TypeError):
            continue
        events[index] = _sse(message).rstrip(b"\n")
    return b"\n\n".join(events)


def _sse(message: dict[str, Any]) -> bytes:
    return SSE_EVENT_PREFIX + pydantic_core.to_json(message) + b"\n\n"
