"""The delta one engine streams for a chat's first token when it runs a reasoning or tool-call parser, read
from the prefill engine's whole reply of that one token. Pure.

vLLM's streamed chat (chat_completion/serving.py, vLLM 0.32) hands each step's text to the parser
(``parse_delta``) and writes an event only for what it returns; None (a tag it consumed or holds back as a
possible tag's start) writes nothing. The prefill leg cannot stream: only a whole reply carries the
``kv_transfer_params`` (vLLM issue 36308), and its message is the parser's reading of the whole reply
(``parse``), which for one token can differ from the streamed step: at the finish the parser flushes what it
held (``finalize_generation``), and a whole reply's unclosed ``<tool_call>`` is content where the stream
holds it. So the message names the delta only where both readings must agree, and otherwise this says so
(the decode engine's first token then comes first): the token's text in one field, with no ``<`` that could
start a tag; nothing (a tag the parser took); or the tool parser's own start tag, which the stream holds
until the call's name follows; and, with a tool parser, not a first token of whitespace alone: vLLM 0.32's
stream writes it as content, 0.26's holds it. tests/pd/test_first_delta.py checks that against vLLM's parsers
for every token of a tokenizer with Qwen3's tags (0.32 installed; 0.26's package first on PYTHONPATH runs the
same test against 0.26's parsers).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pdserve.pd.first_token import FirstToken, Reason, message_texts

# The tag each tool-call parser (--tool-call-parser) starts a call with and holds back while streaming.
TOOL_CALL_STARTS = {"hermes": "<tool_call>"}


def parsed_delta(body: dict[str, Any], first: FirstToken, *, tool_call_parser: str | None) -> FirstToken | Reason:
    """``first`` with the delta one engine streams for it (or ``is_held``: none) where the engines parse
    chat output with ``tool_call_parser`` (its --tool-call-parser, None: none) and maybe a reasoning parser;
    Reason.PARSER_UNSURE where the whole reply does not tell."""
    message = first.message
    if message is None or first.finish_reason is not None or message.get("tool_calls"):
        return Reason.PARSER_UNSURE  # a finish flushes the parser; a call is never one token's
    texts = message_texts(message)
    if not texts:
        return replace(first, is_held=True)
    if len(texts) > 1 and "content" in texts:
        return Reason.PARSER_UNSURE
    field, text = next(iter(texts.items()))
    if tool_call_parser and not text.strip():
        return Reason.PARSER_UNSURE  # vLLM 0.26's hermes stream writes nothing for it, 0.32's writes it
    if "<" not in text:
        return replace(first, delta=texts)
    if field == "content" and text == _held_start(body, tool_call_parser):
        return replace(first, is_held=True)
    return Reason.PARSER_UNSURE


def _held_start(body: dict[str, Any], tool_call_parser: str | None) -> str | None:
    """The tag the tool parser holds back for ``body``: only with tools it may call on its own."""
    if not body.get("tools") or body.get("tool_choice", "auto") not in ("auto", None):
        return None
    return TOOL_CALL_STARTS.get(tool_call_parser or "")

