"""The routes that report on or act on the engines, naming them to the admin only: /health (its engine
listing), /admin/engines, /admin/scale and the live page. (/metrics, which names them too: gateway/app.py.)"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pdserve.access import Access, AccessKeys
from pdserve.config import Settings
from pdserve.engines.members import MembersFolder
from pdserve.errors import BadRequest
from pdserve.gateway import dashboard
from pdserve.gateway.client_reply import JSON
from pdserve.gateway.engine_rows import EngineRow, engine_rows, rows_json, with_leg_counts, workers_counted
from pdserve.gateway.kv_monitor import gateway_bar
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.recent import RecentRequests
from pdserve.gateway.request_input import authorization, check_state_change, header_map, read_body
from pdserve.gateway.scaling import MAX_BODY_BYTES, wanted_pools
from pdserve.gateway.workers import Worker
from pdserve.protocol import parse_json_object
from pdserve.role import Role
from pdserve.routing.pool import Pool

log = logging.getLogger(__name__)


class AdminRoutes:
    """The engine views and /admin/scale, on the gateway's pool, metrics and (under `pdserve up`) members."""

    def __init__(self, settings: Settings, pool: Pool, keys: AccessKeys, *, metrics: GatewayMetrics,
                 recent: RecentRequests, worker: Worker | None, members: MembersFolder | None) -> None:
        self.settings, self.pool, self.keys = settings, pool, keys
        self.metrics, self.recent = metrics, recent
        self._worker = worker  # one of several processes on the port (gateway/workers.py), or None
        self._members = members  # the engines `pdserve up` launched (and scales), or None

    async def health(self, request: Request) -> Response:
        """200 while at least one engine of each role answers its health probe. Lists every engine
        to the admin (to anyone when no key is configured: loopback or access.open): their addresses are internal."""
        counts = {role.value: len(self.pool.healthy(role)) for role in Role}
        is_ready = all(counts.values())
        body: dict[str, Any] = {"status": "ok" if is_ready else "degraded", "healthy_engines": counts}
        if self.keys.grant(authorization(request)) >= Access.ADMIN:
            rows, counted = await self._engine_rows()
            in_flight = {(row.role, row.url): row.in_flight for row in rows}
            if self._worker is not None:  # in_flight is exact for the workers counted: say how many
                body["in_flight_counted"] = {"workers": counted, "of": self._worker.count}
            body["engines"] = {role.value: [
                {"url": endpoint.url, "is_healthy": endpoint.is_healthy,
                 "in_flight": in_flight.get((role, endpoint.url), endpoint.in_flight),
                 "kv_path": dataclasses.asdict(endpoint.kv_path)}
                for endpoint in self.pool.all(role)] for role in Role}
        return Response(json.dumps(body), status_code=200 if is_ready else 503, media_type=JSON)

    async def engines(self, request: Request) -> Response:
        """Every engine's health, load and legs, for the admin only (``pdserve status``)."""
        self.keys.require(authorization(request), Access.ADMIN)
        return Response(json.dumps(rows_json((await self._engine_rows())[0])), media_type=JSON)

    async def _engine_rows(self) -> tuple[list[EngineRow], int]:
        """One row per engine, with the legs of the whole gateway: each of gateway.workers counts
        only its own, and their /metrics, asked now and summed, count all; and how many workers
        answered (one that did not in 2 s is left out, gateway/workers.py)."""
        rows = engine_rows(self.pool, now_s=time.monotonic(), max_age_s=self.settings.routing.load_max_age_s)
        if self._worker is None:
            return rows, 1
        text = (await self._worker.gather_metrics(self.metrics.render())).decode()
        return with_leg_counts(rows, text), workers_counted(text)

    async def scale(self, request: Request) -> Response:
        """GET: the engines `pdserve up` launched, with their states; POST ``{"prefill": N, "decode": M}``:
        ask it for those pool sizes (202: added engines join once ready, removed ones drain first)."""
        if request.method == "POST":
            check_state_change(header_map(request.scope), bound_host=self.settings.gateway.host)
        self.keys.require(authorization(request), Access.ADMIN)
        members = self._members.read() if self._members is not None else None
        if self._members is None or members is None:
            raise BadRequest("this gateway's engines were not launched by `pdserve up`, so it cannot scale them "
                             "(on Ray, Serve's autoscaler sizes the pools: ray.autoscaling)", status=409,
                             code="scaling_unavailable")
        if request.method == "GET":
            return Response(json.dumps(members.to_json()), media_type=JSON)
        body = parse_json_object(await read_body(request.receive, header_map(request.scope), limit=MAX_BODY_BYTES))
        wanted = wanted_pools(body, current=members.wanted, settings=self.settings)
        self._members.request_scale(wanted)
        log.info("admin asked for %s", ", ".join(f"{role.value}={count}" for role, count in wanted.items()))
        reply = {**members.to_json(), "wanted": {role.value: count for role, count in wanted.items()}}
        return Response(json.dumps(reply), status_code=202, media_type=JSON)

    async def dashboard_page(self, request: Request) -> Response:
        """The live page (gateway/dashboard.py), for the admin only: it names engines."""
        if dashboard.grant(self.keys, authorization(request)) < Access.ADMIN:
            return dashboard.ask_for_key()
        return dashboard.page()

    async def dashboard_state(self, request: Request) -> Response:
        """What the live page polls: engines, recent requests, latency and KV counters."""
        if dashboard.grant(self.keys, authorization(request)) < Access.ADMIN:
            return dashboard.ask_for_key()
        rows = engine_rows(self.pool, now_s=time.monotonic(), max_age_s=self.settings.routing.load_max_age_s)
        rows, families = await dashboard.with_metrics(rows, self.metrics, self._worker)
        body = dashboard.state(rows, families, self.recent.latest(), worker=self._worker,
                              kv_bar=gateway_bar(self.settings.gateway))
        return Response(json.dumps(body), media_type=JSON, headers={"cache-control": "no-store"})
