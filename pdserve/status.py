"""``pdserve status``: the running gateway's engines as a kubectl-style table, or as JSON.

The gateway builds the rows (GET /admin/engines, gateway/engine_rows.py); this module fetches and
formats them, and says in one line why it could not (gateway_address.py finds the gateway).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import aiohttp

from pdserve.access import admin_key_needed
from pdserve.deploy.cluster_view import format_table
from pdserve.errors import GatewayUnavailable
from pdserve.gateway.engine_rows import EngineRow, rows_from_json, rows_json
from pdserve.gateway_address import GatewayTarget, unreachable
from pdserve.role import Role

HEADER = ("ROLE", "ADDRESS", "HEALTH", "RUNNING", "WAITING", "KV-USAGE", "PREFIX-HIT", "ROUTED", "KV-RECOMPUTED")
ENGINES_PATH = "/admin/engines"
NOT_READ = "-"  # a load field the gateway has not read lately


async def fetch_rows(gateway: GatewayTarget, *, headers: dict[str, str], timeout_s: float) -> list[EngineRow]:
    """The engines the gateway at ``gateway`` knows. ``headers``: the admin key's
    (``AccessKeys.headers()``). Raises GatewayUnavailable, saying what to do."""
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        body = await admin_json(session, "GET", gateway, ENGINES_PATH)
    try:
        return rows_from_json(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise GatewayUnavailable(f"{gateway.url}{ENGINES_PATH} answered something else than engine rows: "
                                 f"{exc!r}") from exc


async def admin_json(session: aiohttp.ClientSession, method: str, gateway: GatewayTarget, path: str,
                     body: object = None) -> Any:
    """One admin endpoint's JSON answer (2xx). Raises GatewayUnavailable, saying what to do: the
    gateway's own error message where it sent one (a bad scale request, say)."""
    url = gateway.url + path
    try:
        async with session.request(method, url, json=body) as reply:
            if reply.status == 401:
                raise GatewayUnavailable(admin_key_needed(url))
            answer = await reply.json(content_type=None)
    except aiohttp.ClientConnectorError as exc:
        raise unreachable(gateway, exc.strerror or type(exc).__name__) from exc
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        raise GatewayUnavailable(f"cannot read {url}: {exc!r}; is a pdserve gateway there?") from exc
    if reply.status >= 300:
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise GatewayUnavailable(f"{url} answered {reply.status}: {message or 'is a pdserve gateway there?'}")
    return answer


def format_rows(rows: Sequence[EngineRow]) -> str:
    """The table: one line per engine, load fields ``-`` when not read lately."""
    return format_table(HEADER, [(
        row.role.value, row.url.removeprefix("http://"), "healthy" if row.is_healthy else "unhealthy",
        _count(row.running), _count(row.waiting), _percent(row.kv_usage), _percent(row.prefix_hit_rate),
        str(row.routed), str(row.kv_recomputed) if row.role is Role.PREFILL else "",
    ) for row in rows])


def format_json(rows: Sequence[EngineRow]) -> str:
    return json.dumps(rows_json(rows), indent=2)


def _count(value: float | None) -> str:
    return NOT_READ if value is None else f"{value:.0f}"


def _percent(fraction: float | None) -> str:
    return NOT_READ if fraction is None else f"{fraction * 100:.0f}%"
