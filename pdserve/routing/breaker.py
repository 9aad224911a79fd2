"""Circuit breaker: an engine whose legs keep failing leaves the rotation for a while.

The health loop alone would keep such an engine in: an engine can answer ``/health`` and still
fail every request (out of KV memory, a broken NIXL agent, a stalled model loop behind a live
HTTP server). After ``eject_for_s`` it is tried again (half-open): one more failure takes it out
again for twice as long, up to ``eject_max_s``; one success closes the breaker.
"""

from __future__ import annotations

import logging

from pdserve.gateway_config import GatewaySpec
from pdserve.routing.pool import Endpoint

log = logging.getLogger(__name__)


def record_failure(endpoint: Endpoint, *, spec: GatewaySpec, now_s: float) -> bool:
    """Count one failed leg on ``endpoint``; True when that ejects it (``now_s``: time.monotonic())."""
    endpoint.failed_legs += 1
    if endpoint.failed_legs < spec.eject_after_failures:
        return False
    endpoint.failed_legs = spec.eject_after_failures - 1  # half-open: the next failure ejects again
    _eject(endpoint, spec=spec, now_s=now_s, what="failed legs")
    return True


def record_failed_pull(endpoint: Endpoint, *, spec: GatewaySpec, now_s: float) -> bool:
    """Count one handoff of prefill ``endpoint`` whose decode engine computed the prompt again (its
    pull failed); True when that ejects it. Kept apart from failed legs: its prefill legs succeed,
    and each success would close the breaker again."""
    endpoint.failed_pulls += 1
    endpoint.kv_recomputed += 1
    if endpoint.failed_pulls < spec.eject_after_failures:
        return False
    endpoint.failed_pulls = spec.eject_after_failures - 1  # half-open, as for failed legs
    _eject(endpoint, spec=spec, now_s=now_s, what="KV pulls failed")
    return True


def record_pulled(endpoint: Endpoint) -> None:
    """A decode engine had a handoff of ``endpoint`` without computing it: its pulls work."""
    endpoint.failed_pulls = 0


def _eject(endpoint: Endpoint, *, spec: GatewaySpec, now_s: float, what: str) -> None:
    pause_s = min(spec.eject_for_s * 2 ** endpoint.ejections_in_row, spec.eject_max_s)
    endpoint.ejected_until_s = now_s + pause_s
    endpoint.ejections_in_row += 1
    log.warning("%s endpoint %s EJECTED for %.0f s after %d %s in a row; it is tried again after that",
                endpoint.role.value, endpoint.url, pause_s, spec.eject_after_failures, what)


def record_success(endpoint: Endpoint) -> None:
    """A leg went through: the breaker closes."""
    if endpoint.ejections_in_row:
        log.info("%s endpoint %s serves again after its ejection", endpoint.role.value, endpoint.url)
    endpoint.failed_legs = endpoint.ejections_in_row = 0
