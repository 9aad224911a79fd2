"""Whether the prefill engine's token goes to the client as the first token, and reading it. Pure.

A prefill leg samples one token (``max_tokens`` 1) that other PD proxies throw away (vLLM's example proxy;
Ray Serve LLM 2.58's PDDecodeServer, pd_server.py ``_prepare_decode_request``): the decode engine
pulls the prompt's KV cache, recomputes the last prompt token and samples the first token again, so the
client waits for the pull and a decode step before it sees anything. Here the prefill leg asks for token
ids (``return_token_ids``), the gateway streams its token at once (pd/first_events.py writes it as vLLM
would) and the decode engine carries on after it (pd/lead.py), in one of two ways:

- after it: a streamed ``/v1/completions`` with nothing that spans the first two tokens gets a decode leg
  of the prompt's token ids plus that token, so the decode engine computes the one new position (the step
  it spent recomputing the last prompt token) and samples the second token. vLLM's NixlConnector claims
  the whole n + 1 tokens as remote, reads the prefill engine's blocks into them and, the prompt being
  "fully cached", recomputes the last position (``get_num_new_matched_tokens``,
  ``_update_waiting_for_remote_kv``; vLLM 0.26 and 0.32); kv.py's ``fields_for_prompt`` maps the blocks.
  A hybrid model's (Mamba, Gated DeltaNet) prefill leg asks its engine to compute the whole prompt, which vLLM's
  connector would stop a token short (pdserve_vllm/whole_prompt.py): its decode engine loads all but its own
  prompt's last token, here the whole prompt, in the blocks that hold it, and computes the token from the
  recurrent state after it, as one engine's second step does.
- from it (forced): a chat request, whose decode leg cannot take token ids and whose chat layer (role
  event, parsers, usage) must see the token as output, and a completion whose stop strings, output
  penalties, min_tokens, seed or guided decoding span the first two tokens: the decode leg is the
  client's request, and pdserve's logits processor in the decode engine (pdserve_vllm/first_token.py)
  makes its first output token the prefill engine's. That engine then writes one engine's whole stream;
  the gateway drops the events of that first step, which the client had already.
  A hybrid's decode engine would load n - 1 of its n prompt tokens (a chat's prompt cannot be lengthened by the
  token: that engine renders it) and compute the last from the recurrent state after n - 1, so both legs ask
  (``RESTORE_LAST_KEY``): its prefill engine computes the whole prompt, and the decode engine loads all of it and
  undoes its recompute of the last token (pdserve_vllm/restore_last.py).

Not where the output could differ from one engine's (``why_not`` names each case): a prefill engine that
stopped a hybrid's prompt a token short (``remote_num_tokens`` < the prompt), whose token follows n - 1 tokens:
one that does not load pdserve_vllm.hybrid_connector (the gateway says so once), and a forced request whose
prompt's last token ends or starts a cached state block (pdserve_vllm/restore_last.py); a chat request with stop
strings to engines that parse reasoning or tool calls (the text held back for them reaches the parser with a later
token), or whose first token's streamed delta the prefill engine's whole reply does not tell (pd/first_delta.py);
logprobs, echo and token ids describe the first token in fields the gateway does not rebuild; n > 1; continuous
usage stats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from pdserve.pd import resume


class Reason(StrEnum):
    """Why a request's first token came from where it did: the ``reason`` of ``pdserve_first_tokens``."""

    ELIGIBLE = "eligible"  # it came from the prefill engine
    SETTING_OFF = "setting_off"  # gateway.first_token_from_prefill is false
    NOT_STREAMED = "not_streamed"  # a whole reply: there is no first token to send early
    LOCAL = "local"  # no prefill leg: the decode engine prefilled it (routing, or no prefill engine could)
    OTHER_ROUTE = "other_route"
    CHAT_PARSER = "chat_parser"  # stop strings, where the engines parse reasoning or tool calls out of chat output
    PARSER_UNSURE = "parser_unsure"  # the parser's delta for the first token is not told by the prefill reply
    DECODE_CANNOT_FORCE = "decode_cannot_force"  # the decode engines lack pdserve's logits processor
    WITH_LOGPROBS = "with_logprobs"
    WITH_ECHO = "with_echo"
    WITH_TOKEN_IDS = "with_return_token_ids"
    WITH_N = "with_n"
    WITH_CONTINUOUS_USAGE = "with_continuous_usage_stats"
    # a hybrid's prefill engine left the last token (a cached state block's edge, or vLLM's own connector)
    PREFILL_STOPPED_SHORT = "prefill_stopped_short"
    PREFILL_REPLY_UNREADABLE = "prefill_reply_unreadable"
    BLOCKS_UNMAPPED = "blocks_unmapped"  # kv.py cannot map the blocks onto the prompt plus the token


_TEXT_FIELDS = ("content", "reasoning", "reasoning_content")  # a chat message's; vLLM 0.32 names reasoning "reasoning"

# Fields whose effect spans the first two tokens, or reads the first as output: stop strings and
# min_tokens, output penalties, a seeded sampler, guided decoding's state. With any of them set the
# decode engine is given the first token as its own output (forced), not as prompt.
_FORCED_WITH = ("stop", "presence_penalty", "frequency_penalty", "min_tokens", "structured_outputs", "bad_words",
                "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def why_not(body: dict[str, Any], *, path: str, is_stream: bool, decode_forces: bool,
            parses_chat: bool) -> Reason | None:
    """Why ``body`` may not get its first token from the prefill engine; None: it may. Checked once per
    request. ``decode_forces``: the decode engines load pdserve's logits processor; ``parses_chat``: the
    engines run a reasoning or tool-call parser over chat output."""
    if not is_stream:
        return Reason.NOT_STREAMED
    if path not in (resume.COMPLETIONS_PATH, resume.CHAT_PATH):
        return Reason.OTHER_ROUTE
    if path == resume.CHAT_PATH and parses_chat and body.get("stop"):
        return Reason.CHAT_PARSER
    if body.get("logprobs") if path == resume.CHAT_PATH else body.get("logprobs") is not None:
        return Reason.WITH_LOGPROBS  # a completion's logprobs 0 asks for the sampled token's
    if body.get("echo"):
        return Reason.WITH_ECHO
    if body.get("return_token_ids"):
        return Reason.WITH_TOKEN_IDS
    if (body.get("n") or 1) != 1:
        return Reason.WITH_N
    if (body.get("stream_options") or {}).get("continuous_usage_stats"):
        return Reason.WITH_CONTINUOUS_USAGE
    if is_forced(body, path=path) and not decode_forces:
        return Reason.DECODE_CANNOT_FORCE
    return None


def is_forced(body: dict[str, Any], *, path: str) -> bool:
    """Whether the decode engine is to be given the first token as output (pdserve_vllm's logits
    processor), not as prompt: always for chat, and for a completion whose fields span the first two tokens."""
    return path == resume.CHAT_PATH or _spans_first_two(body)


def _spans_first_two(body: dict[str, Any]) -> bool:
    return (any(body.get(field) for field in _FORCED_WITH) or body.get("seed") is not None
            or (body.get("response_format") or {}).get("type", "text") != "text")


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The prefill engine's token, as its reply gave it."""

    token_id: int
    text: str
    finish_reason: str | None  # set: this token ends the reply (a stop token, or max_tokens 1)
    stop_reason: int | str | None
    prompt_tokens: int
    prompt_token_ids: tuple[int, ...]  # a completion's, its decode leg's start (pd/lead.py); a chat's are not read
    reply_id: str
    created: int
    model: str
    # The prefill engine's prompt_tokens_details (cached tokens: engines run --enable-prompt-tokens-details),
    # for the usage the gateway writes when this token ends the reply; None when the reply had none.
    prompt_tokens_details: dict[str, Any] | None = None
    # A chat's: the prefill reply's message; the delta one engine streams for the token where its parser
    # changes it (pd/first_delta.py; None: the token's text as content); is_held: the parser writes no event.
    message: dict[str, Any] | None = None
    delta: dict[str, Any] | None = None
    is_held: bool = False


def read(reply: dict[str, Any]) -> FirstToken | Reason:
    """The first token of a prefill reply asked with ``return_token_ids`` (a completion's or a chat's);
    the reason it cannot lead when the reply lacks what is needed or its engine computed less than the
    whole prompt (a hybrid model's)."""
    try:
        choice = reply["choices"][0]
        (token_id,) = choice["token_ids"]
        is_chat = "message" in choice
        # vLLM puts a completion's prompt ids in its choice (its JSON ints taken as they are: converting each
        # again cost 200 µs per 4k-token prompt, bench/first_token_cost.py); a chat's count is its usage's, which
        # vLLM counts as len(prompt_token_ids) (chat_completion/serving.py, 0.26 and 0.32).
        prompt = () if is_chat else tuple(choice["prompt_token_ids"])
        prompt_tokens = int(reply["usage"]["prompt_tokens"]) if is_chat else len(prompt)
        message = choice["message"] if is_chat else None
        text = message.get("content") if message is not None else choice.get("text")
        computed = reply["kv_transfer_params"].get("remote_num_tokens")
        first = FirstToken(token_id=int(token_id), text=str(text or ""),
                           finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"),
                           prompt_tokens=prompt_tokens, prompt_token_ids=prompt, reply_id=str(reply["id"]),
                           created=int(reply["created"]), model=str(reply["model"]),
                           prompt_tokens_details=(reply.get("usage") or {}).get("prompt_tokens_details"),
                           message=message)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return Reason.PREFILL_REPLY_UNREADABLE
    if computed is not None and int(computed) < prompt_tokens:
        return Reason.PREFILL_STOPPED_SHORT
    return first


_CHAT_PROMPT_IDS = re.compile(rb'"prompt_token_ids"\s*:\s*\[')


def without_chat_prompt_ids(raw: bytes) -> bytes:
    """A chat prefill reply's JSON with ``null`` for its prompt's token ids, which vLLM writes beside the choices
    (``return_token_ids``) and ``read`` does not use: parsing them was 122 of the 140 µs this route cost a 4k-token
    prompt (docs/architecture.md). No JSON string holds the key's quotes unescaped, so a match is the key."""
    found = _CHAT_PROMPT_IDS.search(raw)
    if found is None:
        return raw
    return raw[:found.start()] + b'"prompt_token_ids":null' + raw[raw.index(b"]", found.end()) + 1:]


def message_texts(message: dict[str, Any]) -> dict[str, str]:
    """A chat message's text fields that hold text (content, reasoning), by name."""
    return {field: message[field] for field in _TEXT_FIELDS if message.get(field)}


def for_client(body: dict[str, Any], first: FirstToken, *, path: str, max_model_len: int | None) -> FirstToken:
    """``first`` as the client's request ends it: the prefill leg's own limit of one token is no
    finish unless the client asked for one token or the prompt left room in the context
    (``max_model_len``, None: unknown) for that one only: vLLM caps max_tokens at the context left
    (get_max_tokens, vLLM 0.26 and 0.32), so one engine ends there too."""
    asked = _asked_tokens(body, path=path)
    if first.finish_reason != "length" or (asked is not None and asked <= 1):
        return first
    if max_model_len is not None and first.prompt_tokens + 1 >= max_model_len:
        return first
    return replace(first, finish_reason=None)


def _asked_tokens(body: dict[str, Any], *, path: str) -> int | None:
    """The most tokens the client asked for; None: as many as the context holds (a chat's default)."""
    for field in ("max_completion_tokens", "max_tokens"):
        if body.get(field) is not None:
            return int(body[field])
    return resume.VLLM_DEFAULT_COMPLETION_MAX_TOKENS if path == resume.COMPLETIONS_PATH else None


def streamed_text(body: dict[str, Any], text: str) -> str:
    """What one engine streams of the first token's ``text``: with stop strings it holds back as many
    characters as the longest could still need (vLLM's detokenizer, ``stop_buffer_length``,
    v1/engine/detokenizer.py:85-90, 161-176), and sends them with the next token."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not stops or body.get("include_stop_str_in_output"):
        return text
    held = max(len(one) for one in stops) - 1
    return text[:max(len(text) - held, 0)]
