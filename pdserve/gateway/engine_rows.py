"""The gateway's view of each engine, one row apiece: what GET /admin/engines answers and
``pdserve status`` prints. Pure: the pool and the metrics text come in, rows and JSON go out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdserve.gateway.metrics import ENGINE_LEGS_IN_FLIGHT, ENGINE_LEGS_SENT, WORKERS_COUNTED
from pdserve.role import Role
from pdserve.routing.pool import Pool


@dataclass(frozen=True, slots=True)
class EngineRow:
    """One engine. The load fields are the engine's own, as last read; None when that read is
    older than ``routing.load_max_age_s`` (or there was none): routing ignores it too."""

    role: Role
    url: str
    is_healthy: bool
    in_flight: int  # legs the gateway has open on it
    routed: int  # legs the gateway has sent it
    kv_recomputed: int = 0  # a prefill engine's handoffs its decode engines computed again (pd/kv_proof.py)
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    prefix_hit_rate: float | None = None  # cached share of the prompt tokens it has seen since it started
    load_age_s: float | None = None


def engine_rows(pool: Pool, *, now_s: float, max_age_s: float) -> list[EngineRow]:
    """Every engine of ``pool``, prefill first. ``now_s``: time.monotonic()."""
    rows = []
    for role in Role:
        for endpoint in pool.all(role):
            load, age_s = endpoint.load, endpoint.load.age_s(now_s)
            row = EngineRow(role=role, url=endpoint.url, is_healthy=endpoint.is_healthy,
                            in_flight=endpoint.in_flight, routed=endpoint.routed,
                            kv_recomputed=endpoint.kv_recomputed)
            if age_s <= max_age_s:
                row = replace(row, running=load.running, waiting=load.waiting, kv_usage=load.kv_usage,
                              prefix_hit_rate=load.prefix_hit_rate, load_age_s=round(age_s, 3))
            rows.append(row)
    return rows


def with_leg_counts(rows: Sequence[EngineRow], metrics_text: str) -> list[EngineRow]:
    """``rows`` with the legs in flight and sent taken from ``metrics_text`` (every gateway
    worker's /metrics summed): each worker's pool counts only its own legs."""
    counts: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in (ENGINE_LEGS_IN_FLIGHT, ENGINE_LEGS_SENT + "_total"):
                counts[(sample.name, sample.labels["role"], sample.labels["endpoint"])] = sample.value
    return [replace(row,
                    in_flight=int(counts.get((ENGINE_LEGS_IN_FLIGHT, row.role.value, row.url), row.in_flight)),
                    routed=int(counts.get((ENGINE_LEGS_SENT + "_total", row.role.value, row.url), row.routed)))
            for row in rows]


def workers_counted(metrics_text: str) -> int:
    """How many gateway workers' counts ``metrics_text`` (their /metrics summed) holds: a worker
    that did not answer in time is left out of the sum, and its legs with it."""
    return int(sum(sample.value for family in text_string_to_metric_families(metrics_text)
                   for sample in family.samples if sample.name == WORKERS_COUNTED))


def rows_json(rows: Sequence[EngineRow]) -> dict[str, Any]:
    return {"engines": [asdict(row) for row in rows]}


def rows_from_json(body: Mapping[str, Any]) -> list[EngineRow]:
    """The rows of a /admin/engines answer; raises KeyError, TypeError or ValueError if malformed."""
    return [EngineRow(**{**item, "role": Role(item["role"])}) for item in body["engines"]]
