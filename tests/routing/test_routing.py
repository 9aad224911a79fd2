from __future__ import annotations

from pdserve.role import Role
from pdserve.routing.health import record
from pdserve.routing.policy import LeastInFlight, RoundRobin
from pdserve.routing.pool import Endpoint, Pool


def test_least_in_flight_prefers_idle_and_rotates_ties() -> None:
    pool = Pool(prefill_urls=["a", "b", "c"], decode_urls=[])
    a, b, c = pool.all(Role.PREFILL)
    policy = LeastInFlight()
    with pool.in_flight(a):
        assert {policy.choose([a, b, c]).url for _ in range(4)} == {"b", "c"}
    assert a.in_flight == 0
    assert [RoundRobin().choose([a, b, c]).url for _ in range(1)] == ["a"]


def test_ties_rotate_per_role_when_each_request_chooses_prefill_then_decode() -> None:
    pool = Pool(prefill_urls=["p1", "p2"], decode_urls=["d1", "d2"])
    policy = LeastInFlight()
    chosen = [(policy.choose(pool.all(Role.PREFILL)).url, policy.choose(pool.all(Role.DECODE)).url) for _ in range(4)]
    assert sorted(decode for _, decode in chosen) == ["d1", "d1", "d2", "d2"]
    assert sorted(prefill for prefill, _ in chosen) == ["p1", "p1", "p2", "p2"]


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
