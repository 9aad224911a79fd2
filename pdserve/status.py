"""``pdserve status``: the running gateway's engines as a kubectl-style table, or as JSON.

The gateway builds the rows (GET /admin/engines, gateway/engine_rows.py); this module fetches and
formats them, and says in one line why it could not.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import aiohttp

from pdserve.deploy.cluster_view import format_table
from pdserve.errors import PdserveError
from pdserve.gateway.engine_rows import EngineRow, rows_from_json, rows_json
from pdserve.role import Role

HEADER = ("ROLE", "ADDRESS", "HEALTH", "RUNNING", "WAITING", "KV-USAGE", "PREFIX-HIT", "ROUTED", "KV-RECOMPUTED")
ENGINES_PATH = "/admin/engines"
NOT_READ = "-"  # a load field the gateway has not read lately


class StatusUnavailable(PdserveError):
    """The gateway could not be asked, or would not answer (no admin key, another server)."""


async def fetch_rows(gateway_url: str, *, headers: dict[str, str], timeout_s: float) -> list[EngineRow]:
    """The engines the gateway at ``gateway_url`` knows. ``headers``: the admin key's
    (``AccessKeys.headers()``). Raises StatusUnavailable, saying what to do."""
    url = gateway_url.rstrip("/") + ENGINES_PATH
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        body = await admin_json(session, "GET", url)
    try:
        return rows_from_json(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise StatusUnavailable(f"{url} answered something else than engine rows: {exc!r}") from exc


async def admin_json(session: aiohttp.ClientSession, method: str, url: str, body: object = None) -> Any:
    """One admin endpoint's JSON answer (2xx). Raises StatusUnavailable, saying what to do: the
    gateway's own error message where it sent one (a bad scale request, say)."""
    try:
        async with session.request(method, url, json=body) as reply:
            if reply.status == 401:
                raise StatusUnavailable(f"{url} wants the admin key: set PDSERVE_ADMIN_KEY or gateway.admin_key_file")
            answer = await reply.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        raise StatusUnavailable(f"cannot read {url}: {exc!r}; is the gateway running?") from exc
    if reply.status >= 300:
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise StatusUnavailable(f"{url} answered {reply.status}: {message or 'is a pdserve gateway there?'}")
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
