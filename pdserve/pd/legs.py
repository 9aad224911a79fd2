"""What both legs share: the upstream POST, and turning engine failures into our errors.

Bodies to and from engines go through pydantic-core's JSON (Rust, exact integers): a prompt of
token ids, as the decode leg behind a lead carries it, serialises 4x faster than with ``json``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pydantic_core

from pdserve.errors import LegFailed, UpstreamRejected
from pdserve.pd.engine_http import EngineClient
from pdserve.pd.engine_reply import EngineReply, EngineUnreachable
from pdserve.protocol import REQUEST_ID_HEADER
from pdserve.role import Role


async def post(
    client: EngineClient,
    url: str,
    body: dict[str, Any],
    *,
    role: Role,
    request_id: str,
    timeout_s: float,
    trace_headers: Mapping[str, str] | None = None,
) -> EngineReply:
    """POST ``body`` as JSON; return the open reply once its status is 200.

    ``timeout_s`` bounds connecting and waiting for the reply's status line. ``trace_headers``
    (W3C traceparent, tracestate: gateway/tracing.py) go along when given. Raises
    UpstreamRejected on a 4xx (the client's fault, relayed) and LegFailed on anything else:
    connection errors, timeouts, 5xx. The caller owns (and must close) the reply.
    """
    headers = {REQUEST_ID_HEADER: request_id, "Content-Type": "application/json"}
    if trace_headers:
        headers.update(trace_headers)
    try:
        async with asyncio.timeout(timeout_s):
            reply = await client.post(url, pydantic_core.to_json(body), headers=headers)
    except (EngineUnreachable, TimeoutError) as exc:
        raise leg_failed(role, url, exc, status=None, timeout_s=timeout_s) from exc
    if reply.status == 200:
        return reply
    try:
        async with asyncio.timeout(timeout_s):
            payload = await reply.read()
    except (EngineUnreachable, TimeoutError) as exc:
        raise leg_failed(role, url, exc, status=reply.status, timeout_s=timeout_s) from exc
    finally:
        reply.close()
    if 400 <= reply.status < 500:
        raise UpstreamRejected(role, url, reply.status, payload)
    raise LegFailed(role, url, reply.status, payload[:500].decode(errors="replace"))


def leg_failed(
    role: Role, url: str, exc: EngineUnreachable | TimeoutError, *, status: int | None, timeout_s: float | None
) -> LegFailed:
    """The LegFailed for a failed wait on an engine; a timeout is marked so the gateway answers 504."""
    if isinstance(exc, TimeoutError):
        return LegFailed(role, url, status, f"no reply within {timeout_s:g} s", is_timeout=True)
    return LegFailed(role, url, status, str(exc))
