"""Which prefill requests of a hybrid model keep their whole prompt where vLLM's NixlConnector drops its last token.
Pure: no vLLM, no torch; hybrid_connector.py applies it inside the engine.

A recurrent state (Mamba, Gated DeltaNet) cannot be stepped back a token, and vLLM's decode engine always computes
the last token of its own prompt: so for a hybrid model its NixlConnector has the prefill engine compute all but the
last prompt token, and the decode engine load that many and compute the last from the state handed over (prefill
side: ``_truncate_mamba_request_for_prefill``, run from get_num_new_matched_tokens, vLLM 0.26;
``_truncate_request_for_prefill``, run from on_new_request, 0.32; decode side: ``_get_remote_prefill_token_count``,
its prompt less one, in both). The prefill engine's token then follows a prompt short of a token: no first token.

A streamed completion whose decode leg is the prompt plus the prefill engine's token (pdserve/pd/lead.py) gives the
decode engine a prompt of n + 1 tokens: it loads n and computes the token, which needs the state after the whole
prompt. Its prefill leg asks for that (``WHOLE_PROMPT_KEY``); the truncation is skipped by setting the guard that
both versions check first (``_p_side_truncated``, which keeps a preempted request from being cut twice).
"""

from __future__ import annotations

from typing import Any

from pdserve_vllm import WHOLE_PROMPT_KEPT_KEY, WHOLE_PROMPT_KEY

TRUNCATED_GUARD = "_p_side_truncated"  # vLLM's: once set, its connector leaves the prompt alone (0.26, 0.32)


def keeps_whole_prompt(params: dict[str, Any] | None, *, has_mamba: bool, backoff: int | None) -> bool:
    """Whether a request with ``params`` (its kv_transfer_params) is to keep its whole prompt: it asks to, it is a
    prefill for a remote decode engine, the model has recurrent layers and vLLM would keep exactly one token off
    this engine (``backoff``; more where 0.32 also keeps speculative decoding's lookahead off it, and the decode
    leg of pd/lead.py would not line up; None: a connector whose truncation this does not know)."""
    return (params is not None and params.get(WHOLE_PROMPT_KEY) is True and bool(params.get("do_remote_decode"))
            and has_mamba and backoff == 1 and not params.get(TRUNCATED_GUARD))


def keep_whole_prompt(params: dict[str, Any]) -> None:
    """Mark ``params`` (a request's own kv_transfer_params) so vLLM does not truncate it, and that it did not."""
    params[TRUNCATED_GUARD] = True
    params[WHOLE_PROMPT_KEPT_KEY] = True


def mark_reply(request_params: dict[str, Any] | None, reply_params: dict[str, Any] | None) -> dict[str, Any] | None:
    """A finished request's reply kv_transfer_params, saying ``WHOLE_PROMPT_KEPT_KEY`` where it kept its whole
    prompt: the gateway then maps the handoff onto the prompt plus one token (pdserve/pd/kv.py)."""
    if reply_params is None or not (request_params or {}).get(WHOLE_PROMPT_KEPT_KEY):
        return reply_params
    return {**reply_params, WHOLE_PROMPT_KEPT_KEY: True}
