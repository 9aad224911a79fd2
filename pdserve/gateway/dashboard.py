"""The live page: GET /dashboard serves one self-contained HTML file (dashboard.html beside this
module: inline CSS, JS and hand-drawn SVG charts, nothing fetched from elsewhere), which polls
GET /dashboard/state once a second. Both are the admin's, as /admin/engines is.

This module builds the state from what the gateway already keeps (engine rows, its metric
registry, the recent requests); it never reads an engine itself.
"""

from __future__ import annotations

import base64
import binascii
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from functools import cache
from importlib import resources
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import Response

from pdserve.access import Access, AccessKeys
from pdserve.gateway.engine_rows import EngineRow, with_leg_counts
from pdserve.gateway.metrics import ENGINE_KV_SLOW, GatewayMetrics
from pdserve.gateway.recent import FinishedRequest
from pdserve.gateway.workers import Worker
from pdserve.pd.slow_kv import KvBar
from pdserve.role import Role

PAGE_PATH, STATE_PATH = "/dashboard", "/dashboard/state"
POLL_INTERVAL_S = 1.0  # the page's; written into it
Sample = tuple[str, dict[str, str], float]  # name, labels, value
_TTFT, _ITL = "pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds"
_KV_FIELDS = {"pdserve_engine_kv_transfer_bytes_total": "kv_bytes",
              "pdserve_engine_kv_transfer_seconds_total": "kv_seconds",
              "pdserve_engine_kv_transfers_total": "kv_transfers",
              "pdserve_engine_kv_transfer_failures_total": "kv_failures",
              ENGINE_KV_SLOW: "kv_slow"}  # the gateway's verdict (gateway/kv_monitor.py): the page's alarm
# The page loads nothing but itself and its state: a stray external asset is refused (and logged by the browser).
_PAGE_HEADERS = {
    "cache-control": "no-store",
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
}


def grant(keys: AccessKeys, authorization: bytes | None) -> Access:
    """What ``authorization`` grants on the page: a Bearer key as on every route, or the key as a
    browser's Basic password (any user name), which is what its login prompt sends."""
    scheme, _, credentials = (authorization or b"").strip().partition(b" ")
    if scheme.lower() != b"basic":
        return keys.grant(authorization)
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True)
    except (binascii.Error, ValueError):
        return keys.grant(None)
    return keys.grant(b"Bearer " + decoded.partition(b":")[2])


def ask_for_key() -> Response:
    """401 with a Basic challenge, so a browser asks for the admin key (as the password)."""
    return Response("The dashboard needs the admin key: give it as the password.\n", status_code=401,
                    media_type="text/plain", headers={"www-authenticate": 'Basic realm="pdserve", charset="UTF-8"'})


def page() -> Response:
    return Response(_page_html(), media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)


@cache
def _page_html() -> str:
    html = resources.files("pdserve.gateway").joinpath("dashboard.html").read_text(encoding="utf-8")
    return html.replace("__STATE_PATH__", STATE_PATH).replace("__POLL_MS__", str(int(POLL_INTERVAL_S * 1000)))


async def with_metrics(rows: Sequence[EngineRow], metrics: GatewayMetrics,
                       worker: Worker | None) -> tuple[list[EngineRow], list[Metric]]:
    """``rows`` and the gateway's metrics: this process's registry, or every worker's summed, with
    the rows' leg counts taken from that sum (each worker counts only its own legs)."""
    if worker is None:
        return list(rows), list(metrics.registry.collect())
    text = (await worker.gather_metrics(metrics.render())).decode()
    return with_leg_counts(rows, text), list(text_string_to_metric_families(text))


def state(rows: Sequence[EngineRow], families: Sequence[Metric], recent: Sequence[FinishedRequest], *,
          worker: Worker | None, kv_bar: KvBar) -> dict[str, Any]:
    """What the page draws, as JSON-ready data. Counters are cumulative (the page takes the
    differences between polls); times are seconds; ``kv_bar`` is the gateway's (gateway.slow_kv_gbps and
    slow_kv_min_ms), its rate drawn across the KV chart; the alarm is the gateway's own verdict
    (``kv_slow``: engines judged slow), never the page's. Pure but for reading the clock."""
    samples = list(samples_of(families))
    kv = _kv_by_endpoint(samples)
    return {
        "now_unix_s": time.time(),
        "worker": None if worker is None else {"index": worker.index, "count": worker.count},
        "gateway": {"in_flight": _sum(samples, "pdserve_in_flight"), "queued": _sum(samples, "pdserve_queue_depth"),
                    "answered": _sum(samples, "pdserve_requests_total"),
                    "errors": _sum(samples, "pdserve_requests_total", lambda labels: labels.get("status") != "200")},
        "engines": [{**asdict(row), **kv.get(row.url, {})} if row.role is Role.DECODE else asdict(row)
                    for row in rows],
        "requests": [asdict(request) for request in recent],
        "ttft": histogram(samples, _TTFT),
        "itl": histogram(samples, _ITL),
        "kv": {field: sum(engine.get(field, 0.0) for engine in kv.values()) for field in _KV_FIELDS.values()},
        "kv_bar_gbps": kv_bar.gbps,
        "kv_allowance_ms": kv_bar.allowance_ms,
    }


def histogram(samples: Sequence[Sample], name: str) -> dict[str, Any]:
    """``name``'s buckets summed over its labels (the modes): upper bounds with cumulative counts,
    +Inf left out (it equals ``count``)."""
    buckets: dict[float, float] = {}
    for sample_name, labels, value in samples:
        if sample_name == name + "_bucket" and math.isfinite(bound := float(labels["le"])):
            buckets[bound] = buckets.get(bound, 0.0) + value
    bounds = sorted(buckets)
    return {"bounds_s": bounds, "cumulative": [buckets[bound] for bound in bounds],
            "sum_s": _sum(samples, name + "_sum"), "count": _sum(samples, name + "_count")}


def samples_of(families: Iterable[Metric]) -> Iterable[Sample]:
    """Every sample of ``families`` as (name, labels, value)."""
    for family in families:
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


def _sum(samples: Sequence[Sample], name: str, where: Callable[[dict[str, str]], bool] | None = None) -> float:
    return sum(value for sample_name, labels, value in samples
               if sample_name == name and (where is None or where(labels)))


def _kv_by_endpoint(samples: Sequence[Sample]) -> dict[str, dict[str, float]]:
    """Each decode engine's KV-transfer counters as the gateway last read them (cumulative)."""
    engines: dict[str, dict[str, float]] = {}
    for name, labels, value in samples:
        if name in _KV_FIELDS:
            fields = engines.setdefault(labels["endpoint"], {})
            fields[_KV_FIELDS[name]] = fields.get(_KV_FIELDS[name], 0.0) + value
    return engines
