"""The prefill engine's token as the lead of a stream: what the client gets at once, the decode leg that
carries on after it, and what of the decode engine's stream the client then must not get twice. Pure.

Which requests, and the two ways a decode engine carries on (after the token, or from it), are in
pd/first_token.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pydantic_core

from pdserve.pd import first_events, first_token, resume
from pdserve.pd.first_token import FirstToken, Reason
from pdserve.pd.kv import KVTransferParams
from pdserve.protocol import SSE_EVENT_PREFIX
from pdserve_vllm import FIRST_TOKEN_ARG

USAGE_MARK = b'"usage":{'  # vLLM's usage event, compact JSON (pydantic's model_dump_json)


@dataclass(frozen=True, slots=True)
class Lead:
    """The first token's events, and the request that continues after it on any decode engine."""

    events: bytes
    continuation: dict[str, Any]  # the decode leg's body without the KV handoff: that engine prefills
    is_forced: bool  # the decode engine writes the first token again (its own output), else it starts after it
    echoed_events: int  # events the decode engine writes for the first token (forced): the client had them
    text: str  # what the client got of the first token's text
    # Where that text is in the token's event: "text" (a completion's), a chat delta's field, or None where
    # the token has no event of its own (a chat parser wrote nothing for it: only the role event is echoed).
    text_field: str | None = "text"
    # The prefill engine's prompt_tokens_details: that engine computed the prompt, so its cached tokens are what one
    # engine reports; the decode engine's count the pulled prompt as cached (pd/kv_proof.py). None: it wrote none.
    prompt_tokens_details: dict[str, Any] | None = None


def make_lead(body: dict[str, Any], first: FirstToken, kv: KVTransferParams, *,
         path: str) -> tuple[dict[str, Any], Lead] | Reason:
    """The decode leg's body and the lead for ``first``, the prefill engine's token of the handoff ``kv``;
    the reason there is none where kv.py cannot map the blocks onto the prompt plus that token."""
    if first_token.is_forced(body, path=path):
        text = first_token.streamed_text(body, first.text)
        field = _text_field(first, path=path)
        lead = Lead(first_events.token_events(body, first, path=path, text=text), _forced(body, first), is_forced=True,
                    echoed_events=(2 if field else 1) if path == resume.CHAT_PATH else 1,
                    text=text if field in ("text", "content") else str((first.delta or {}).get(field or "", "")),
                    text_field=field, prompt_tokens_details=first.prompt_tokens_details)
        return forced_body(body, first, kv), lead
    fields = kv.fields_for_prompt(first.prompt_tokens + 1)
    if fields is None:
        return Reason.BLOCKS_UNMAPPED
    continuation = {**body, **resume.shorter_limits(body, 1, path=path),
                    "prompt": [*first.prompt_token_ids, first.token_id]}
    lead = Lead(first_events.token_events(body, first, path=path, text=first.text), continuation, is_forced=False,
                echoed_events=0, text=first.text, prompt_tokens_details=first.prompt_tokens_details)
    return {**continuation, "kv_transfer_params": fields}, lead


def forced_body(body: dict[str, Any], first: FirstToken, kv: KVTransferParams) -> dict[str, Any]:
    """The decode leg that writes ``first`` (the prefill engine's token) as its own first output token, pdserve's
    logits processor forcing it, with the handoff ``kv``; a hybrid's whole-prompt handoff asks that engine to undo
    its recompute of the prompt's last token (kv.py)."""
    return {**_forced(body, first), "kv_transfer_params": kv.fields_for_forced()}


def _forced(body: dict[str, Any], first: FirstToken) -> dict[str, Any]:
    """``body`` asking its engine to start with ``first`` (pdserve's logits processor), without a handoff."""
    return {**body, "vllm_xargs": {**(body.get("vllm_xargs") or {}), FIRST_TOKEN_ARG: first.token_id}}


def _text_field(first: FirstToken, *, path: str) -> str | None:
    """Where the first token's text goes in its event (Lead.text_field)."""
    if path != resume.CHAT_PATH:
        return "text"
    if first.is_held:
        return None
    return next(iter(first.delta)) if first.delta else "content"


@dataclass(frozen=True, slots=True)
class Dropped:
    """A decode chunk without the events the client had already."""

    chunk: bytes
    left: int  # echoed events still to come
    is_other_token: bool  # the echoed token's text was not the lead's: that engine sampled its own


def drop_echoed(chunk: bytes, left: int, *, lead: Lead, path: str) -> Dropped:
    """``chunk`` without its first ``left`` data events (the decode engine's role and first-token events).

    Where vLLM's server fell behind its engine, one event holds the first two steps' text (its output
    collector merges them): that event stays, with the first token's text taken off its front.
    """
    events = chunk.split(b"\n\n")
    kept: list[bytes] = []
    is_other_token = False
    for event in events:
        if not left or not event.startswith(SSE_EVENT_PREFIX):
            kept.append(event)
            continue
        left -= 1
        if left == 0 and lead.text_field is not None:  # the first token's own event
            rest, is_other_token = _after_lead(event, lead=lead, path=path)
            if rest is not None:
                kept.append(rest)
    return Dropped(b"\n\n".join(kept), left, is_other_token)


def _after_lead(event: bytes, *, lead: Lead, path: str) -> tuple[bytes | None, bool]:
    """What is left of the decode engine's first-token event once the lead's text is taken off it:
    None when nothing is, and whether its text did not start with the lead's."""
    try:
        message = pydantic_core.from_json(event[len(SSE_EVENT_PREFIX):])
        choice = message["choices"][0]
        holder = choice["delta"] if path == resume.CHAT_PATH else choice
        key = lead.text_field or "content"
        text = holder.get(key) or ""
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None, True
    if text == lead.text and choice.get("finish_reason") is None:
        return None, False
    if not text.startswith(lead.text):
        return None, True
    holder[key] = text[len(lead.text):]
    return first_events.sse(message).rstrip(b"\n"), False


def usage_as_one_engines(chunk: bytes, *, lead: Lead) -> bytes:
    """``chunk`` with the decode engine's usage event as one engine writes it for the request (``one_engines_usage``)."""
    events = chunk.split(b"\n\n")
    for index, raw in enumerate(events):
        if USAGE_MARK not in raw or not raw.startswith(SSE_EVENT_PREFIX):
            continue
        try:
            message = pydantic_core.from_json(raw[len(SSE_EVENT_PREFIX):])
            message["usage"] = one_engines_usage(message["usage"], lead=lead)
        except (ValueError, KeyError, TypeError):
            continue
        events[index] = first_events.sse(message).rstrip(b"\n")
    return b"\n\n".join(events)


def one_engines_usage(usage: dict[str, Any], *, lead: Lead) -> dict[str, Any]:
    """The decode engine's ``usage`` behind ``lead`` as one engine writes it: a lead it had as prompt (not forced)
    counted as output; the prompt's cached tokens the prefill engine's (``Lead.prompt_tokens_details``), else no more
    than the prompt. completion_tokens_details stay the decode engine's: its chat layer parsed every output token,
    a forced lead's included, and vLLM 0.32 counts reasoning tokens from those alone (chat_completion/serving.py:
    685-691, 832-851 streamed, 1007 whole; docs/architecture.md, "Usage through PD")."""
    usage = dict(usage)
    if not lead.is_forced:
        usage["prompt_tokens"] -= 1
        usage["completion_tokens"] += 1
    details = usage.get("prompt_tokens_details")
    if details is not None and lead.prompt_tokens_details is not None:
        usage["prompt_tokens_details"] = lead.prompt_tokens_details
    elif details is not None and details.get("cached_tokens", 0) > usage["prompt_tokens"]:
        usage["prompt_tokens_details"] = {**details, "cached_tokens": usage["prompt_tokens"]}
    return usage
