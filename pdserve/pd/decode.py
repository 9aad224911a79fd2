"""The decode leg: hand the KV parameters to a decode engine and relay what it generates."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

from pdserve.pd import legs
from pdserve.pd.engine_http import EngineClient
from pdserve.pd.engine_reply import EngineReply, EngineUnreachable
from pdserve.pd.kv import KVTransferParams
from pdserve.protocol import REQUEST_ID_HEADER
from pdserve.role import Role

log = logging.getLogger(__name__)
# A model no engine serves: the decode engine refuses the request before it reaches its scheduler.
RELEASE_MODEL = "pdserve-release-kv"


def make_body(body: dict[str, Any], kv: KVTransferParams) -> dict[str, Any]:
    """The client's original request plus the prefill engine's KV parameters. Pure."""
    return {**body, "kv_transfer_params": dict(kv.fields)}


async def open_stream(
    client: EngineClient,
    url: str,
    body: dict[str, Any],
    *,
    request_id: str,
    timeout_s: float,
    trace_headers: Mapping[str, str] | None = None,
) -> EngineReply:
    """Start the decode leg; the returned reply's body is the engine's reply (SSE or JSON).

    Returning before the body is read lets the gateway answer errors with a proper status,
    yet start streaming tokens as soon as the first one arrives. ``timeout_s`` bounds the wait
    for the reply's headers. The caller closes it.
    """
    return await legs.post(client, url, body, role=Role.DECODE, request_id=request_id, timeout_s=timeout_s,
                           trace_headers=trace_headers)


def make_release_body(kv: KVTransferParams) -> dict[str, Any]:
    """A request that hands ``kv`` to a decode engine only to be refused. Pure.

    vLLM's decode engine answers a refused request that carries remote-prefill parameters by
    telling the prefill engine to free those blocks (its KV-transfer rejection clean-up), and it
    reads none of them: so giving a handoff back is safe even if another engine pulled it. The
    refusal must come from the handler (an unknown model), not from the request's validation: a
    body refused before it reaches the handler (an empty prompt is) frees nothing.
    """
    return {"model": RELEASE_MODEL, "prompt": "x", "max_tokens": 1, "kv_transfer_params": dict(kv.fields)}


async def release_kv(client: EngineClient, decode_url: str, kv: KVTransferParams, *, request_id: str,
                     timeout_s: float) -> None:
    """Give back a handoff no decode leg will take, so that its prefill engine frees the blocks
    before the connector's lease runs out (docs/reliability.md, "Cancellation"). Raises
    EngineUnreachable or TimeoutError."""
    payload = json.dumps(make_release_body(kv)).encode()
    headers = {REQUEST_ID_HEADER: f"{request_id}-release", "Content-Type": "application/json"}
    try:
        async with asyncio.timeout(timeout_s):
            reply = await client.post(decode_url + "/v1/completions", payload, headers=headers)
            try:
                await reply.read()
            finally:
                reply.close()
    except (EngineUnreachable, TimeoutError) as exc:
        log.warning("request_id=%s could not give the KV handoff back through %s: %r", request_id, decode_url, exc)
        raise
    log.info("request_id=%s gave the unused KV handoff back (%d blocks) through %s",
             request_id, kv.block_count, decode_url)
