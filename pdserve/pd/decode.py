"""The decode leg: hand the KV parameters to a decode engine and relay what it generates."""

from __future__ import annotations

from typing import Any

from pdserve.pd import legs
from pdserve.pd.engine_http import EngineClient, EngineReply
from pdserve.pd.kv import KVTransferParams
from pdserve.role import Role


def make_body(body: dict[str, Any], kv: KVTransferParams) -> dict[str, Any]:
    """The client's original request plus the prefill engine's KV parameters. Pure."""
    return {**body, "kv_transfer_params": dict(kv.fields)}


async def open_stream(
    client: EngineClient,
    url: str,
    body: dict[str, Any],
    *,
    request_id: str,
    idle_timeout_s: float,
) -> EngineReply:
    """Start the decode leg; the returned reply's body is the engine's reply (SSE or JSON).

    Returning before the body is read lets the gateway answer errors with a proper status,
    yet start streaming tokens as soon as the first one arrives. The caller closes it.
    """
    return await legs.post(client, url, body, role=Role.DECODE, request_id=request_id, timeout_s=idle_timeout_s)
