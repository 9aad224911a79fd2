"""What both legs share: the upstream POST, and turning engine failures into our errors."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from pdserve.errors import LegFailed, UpstreamRejected
from pdserve.protocol import REQUEST_ID_HEADER
from pdserve.role import Role


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    role: Role,
    request_id: str,
    timeout: aiohttp.ClientTimeout,
) -> aiohttp.ClientResponse:
    """POST ``body`` as JSON; return the open response once its status is 200.

    Raises UpstreamRejected on a 4xx (the client's fault, relayed) and LegFailed on anything
    else: connection errors, timeouts, 5xx. The caller owns (and must release) the response.
    """
    headers = {REQUEST_ID_HEADER: request_id, "Content-Type": "application/json"}
    try:
        response = await session.post(url, data=json.dumps(body), headers=headers, timeout=timeout)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise LegFailed(role, url, None, f"{type(exc).__name__}: {exc}") from exc
    if response.status == 200:
        return response
    try:
        payload = await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise LegFailed(role, url, response.status, "error body lost") from exc
    finally:
        response.release()
    if 400 <= response.status < 500:
        raise UpstreamRejected(role, response.status, payload)
    raise LegFailed(role, url, response.status, payload[:500].decode(errors="replace"))
