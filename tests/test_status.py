"""`pdserve status`'s table: kubectl's layout, load fields `-` when not read lately."""

from __future__ import annotations

from pdserve.gateway.engine_rows import EngineRow
from pdserve.role import Role
from pdserve.status import format_rows


def test_status_table_has_one_aligned_line_per_engine() -> None:
    rows = [
        EngineRow(Role.PREFILL, "http://10.0.0.7:8100", is_healthy=True, in_flight=1, routed=120, kv_recomputed=2,
                  running=1,
                  waiting=0, kv_usage=0.031, prefix_hit_rate=None, load_age_s=0.4),
        EngineRow(Role.DECODE, "http://10.0.0.7:8200", is_healthy=True, in_flight=3, routed=98, running=3,
                  waiting=2, kv_usage=0.456, prefix_hit_rate=0.8125, load_age_s=0.4),
        EngineRow(Role.DECODE, "http://10.0.0.8:8200", is_healthy=False, in_flight=0, routed=7),
    ]
    assert format_rows(rows).splitlines() == [
        "ROLE      ADDRESS         HEALTH      RUNNING   WAITING   KV-USAGE   PREFIX-HIT   ROUTED   KV-RECOMPUTED",
        "prefill   10.0.0.7:8100   healthy     1         0         3%         -            120      2",
        "decode    10.0.0.7:8200   healthy     3         2         46%        81%          98",
        "decode    10.0.0.8:8200   unhealthy   -         -         -          -            7",
    ]
