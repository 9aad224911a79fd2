"""The prefill leg: compute the prompt's KV cache on a prefill engine and keep it for decode."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pydantic_core

from pdserve.errors import LegFailed
from pdserve.pd import first_token, kv_proof, legs, resume
from pdserve.pd.engine_http import EngineClient
from pdserve.pd.engine_reply import EngineUnreachable
from pdserve.pd.kv import REMOTE_DECODE_REQUEST, KVTransferParams
from pdserve.role import Role
from pdserve_vllm import RESTORE_LAST_KEY, WHOLE_PROMPT_KEY

# Fields that make no sense for a one-token, non-streamed prefill.
_DROPPED_FIELDS = ("stream_options", "min_tokens", "max_completion_tokens", "logprobs", "top_logprobs")


def make_body(body: dict[str, Any], *, connector: str, wants_first_token: bool = False,
              wants_whole_prompt: bool = False, wants_restore_last: bool = False) -> dict[str, Any]:
    """The client's request reshaped for the prefill leg. Pure.

    One token, not streamed: the reply is then a single JSON object that carries the
    ``kv_transfer_params`` the decode engine needs to pull the cache; with ``wants_first_token``
    also the prompt's and the token's ids (pd/first_token.py); with ``wants_whole_prompt`` a hybrid
    model's prefill engine computes the last prompt token too (pdserve_vllm/whole_prompt.py), for a decode leg of
    the prompt plus that engine's token (pd/lead.py) or, with ``wants_restore_last``, for one given that token as
    output, whose engine undoes its recompute of the last prompt token (pdserve_vllm/restore_last.py).
    """
    prefill_body = {key: value for key, value in body.items() if key not in _DROPPED_FIELDS}
    prefill_body.update(
        max_tokens=1,
        stream=False,
        kv_transfer_params=dict(REMOTE_DECODE_REQUEST[connector]),
    )
    if body.get("min_tokens"):  # the token must not end the reply where one engine could not (vLLM refuses > 1 here)
        prefill_body["min_tokens"] = 1
    if wants_first_token:
        prefill_body["return_token_ids"] = True
    if wants_whole_prompt:
        prefill_body["kv_transfer_params"][WHOLE_PROMPT_KEY] = True
    if wants_restore_last:
        prefill_body["kv_transfer_params"][RESTORE_LAST_KEY] = True
    return prefill_body


async def run(
    client: EngineClient,
    url: str,
    body: dict[str, Any],
    *,
    request_id: str,
    timeout_s: float,
    trace_headers: Mapping[str, str] | None = None,
    wants_first_token: bool = False,
) -> KVTransferParams:
    """POST the prefill body to ``url``; return the engine's KV transfer parameters, and its token
    with ``wants_first_token`` (the body made so by ``make_body``).

    ``timeout_s`` bounds the whole leg. Raises UpstreamRejected (4xx, e.g. prompt too long) or LegFailed.
    """
    deadline_s = asyncio.get_running_loop().time() + timeout_s
    response = await legs.post(client, url, body, role=Role.PREFILL, request_id=request_id, timeout_s=timeout_s,
                               trace_headers=trace_headers)
    try:
        async with asyncio.timeout_at(deadline_s):
            raw = await response.read()
            reply = pydantic_core.from_json(first_token.without_chat_prompt_ids(raw) if wants_first_token and
                                            url.endswith(resume.CHAT_PATH) else raw)
    except (EngineUnreachable, TimeoutError) as exc:
        raise legs.leg_failed(Role.PREFILL, url, exc, status=200, timeout_s=timeout_s) from exc
    except ValueError as exc:
        raise LegFailed(Role.PREFILL, url, 200, f"unreadable reply: {exc}") from exc
    finally:
        response.close()
    params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
    if not params:
        detail = "reply has no kv_transfer_params: is the engine started with a KV connector?"
        raise LegFailed(Role.PREFILL, url, 200, detail)
    prompt_tokens = int((reply.get("usage") or {}).get("prompt_tokens") or 0)
    first = first_token.read(reply) if wants_first_token else None
    # Not passed on: the decode engine would report the prefill engine's cached tokens as its own (pd/kv_proof.py).
    fields = {name: value for name, value in params.items() if name != kv_proof.DROPPED_FIELD}
    return KVTransferParams(fields=fields, prompt_tokens=prompt_tokens, first=first)
