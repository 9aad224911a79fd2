from __future__ import annotations

from pdserve.role import Role
from pdserve.routing.health import record
from pdserve.routing.pool import Endpoint


def test_busy_engine_survives_missed_probes_but_dead_one_is_ejected_at_once() -> None:
    busy, dead = Endpoint(Role.DECODE, "busy"), Endpoint(Role.DECODE, "dead")
    for _ in range(2):
        record(busy, "TimeoutError after 5 s", unhealthy_after_failures=3)
    assert busy.is_healthy
    record(busy, "TimeoutError after 5 s", unhealthy_after_failures=3)
    assert not busy.is_healthy
    record(busy, None, unhealthy_after_failures=3)
    assert busy.is_healthy and busy.failed_probes == 0
    record(dead, "unreachable: connection refused", unhealthy_after_failures=3)
    assert not dead.is_healthy
