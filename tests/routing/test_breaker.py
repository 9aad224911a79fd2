"""The circuit breaker: ejected after failures in a row, back after the pause, doubled when it fails again."""

from __future__ import annotations

from pdserve.gateway_config import GatewaySpec
from pdserve.role import Role
from pdserve.routing import breaker
from pdserve.routing.pool import Endpoint, Pool

SPEC = GatewaySpec(eject_after_failures=3, eject_for_s=5.0, eject_max_s=12.0)


def test_ejected_after_failures_in_row_and_a_success_in_between_resets_the_count() -> None:
    endpoint = Endpoint(Role.DECODE, "http://d")
    assert not breaker.record_failure(endpoint, spec=SPEC, now_s=0.0)
    breaker.record_success(endpoint)
    assert not breaker.record_failure(endpoint, spec=SPEC, now_s=0.0)
    assert not breaker.record_failure(endpoint, spec=SPEC, now_s=0.0)
    assert breaker.record_failure(endpoint, spec=SPEC, now_s=100.0)
    assert endpoint.ejected_until_s == 105.0


def test_half_open_one_failure_ejects_again_for_twice_as_long_up_to_the_cap() -> None:
    endpoint = Endpoint(Role.DECODE, "http://d")
    for _ in range(3):
        breaker.record_failure(endpoint, spec=SPEC, now_s=0.0)
    assert breaker.record_failure(endpoint, spec=SPEC, now_s=10.0) and endpoint.ejected_until_s == 20.0
    assert breaker.record_failure(endpoint, spec=SPEC, now_s=30.0) and endpoint.ejected_until_s == 42.0  # capped
    breaker.record_success(endpoint)
    assert not breaker.record_failure(endpoint, spec=SPEC, now_s=50.0)


def test_the_pool_leaves_ejected_engines_out_until_their_pause_ends() -> None:
    pool = Pool(decode_urls=["http://a", "http://b"])
    a, b = pool.all(Role.DECODE)
    a.ejected_until_s = float("inf")
    assert pool.healthy(Role.DECODE) == [b]
    a.ejected_until_s = 0.0
    assert pool.healthy(Role.DECODE) == [a, b]
