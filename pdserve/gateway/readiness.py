"""Readiness that means ready: engines of both roles answer their health probes, and one request
has gone through both legs since (so the KV connector's handshake is done before users come).

The gateway sends that warm-up request itself, so ``pdserve up``, Ray and Kubernetes all become
ready the same way; their callers only wait for ``/health/ready``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pdserve.errors import PdserveError
from pdserve.gateway.call import Call
from pdserve.gateway.client_errors import client_error
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.role import Role
from pdserve.routing.decision import Mode
from pdserve.routing.health import next_look_s
from pdserve.routing.pool import Pool

log = logging.getLogger(__name__)
WARM_UP_PATH = "/v1/completions"


class WarmUp(StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"  # the last attempt failed; another follows


@dataclass(slots=True)
class Readiness:
    """The warm-up's state; the gateway is ready while it is done and both roles have engines."""

    warm_up: WarmUp = WarmUp.PENDING
    warm_up_error: str = ""  # what a client would have been told: no engine address

    def report(self, pool: Pool) -> tuple[bool, dict[str, Any]]:
        """(is ready, the body /health/ready answers with)."""
        counts = {role.value: len(pool.healthy(role)) for role in Role}
        is_ready = self.warm_up is WarmUp.DONE and all(counts.values())
        body: dict[str, Any] = {"status": "ready" if is_ready else "not_ready", "healthy_engines": counts,
                                "warm_up": self.warm_up.value}
        if self.warm_up is WarmUp.FAILED:
            body["warm_up_error"] = self.warm_up_error
        return is_ready, body


async def keep_warm(orchestrator: Orchestrator, pool: Pool, readiness: Readiness, *, model: str,
                    interval_s: float) -> None:
    """Forever: once engines of both roles are healthy, send one warm-up request through both legs,
    every ``interval_s`` until one succeeds; after a role had no engine at all, again. Until both
    roles have one, it looks as often as the health probes do (``health.next_look_s``), so the
    warm-up follows the engines at once."""
    while True:
        if not pool.can_serve:
            if readiness.warm_up is WarmUp.DONE:
                log.warning("a role has no healthy engine: not ready until a new warm-up succeeds")
            readiness.warm_up = WarmUp.PENDING
            await asyncio.sleep(next_look_s(pool, interval_s))
            continue
        if readiness.warm_up is not WarmUp.DONE:
            await warm_up(orchestrator, readiness, model=model)
        await asyncio.sleep(interval_s)


async def warm_up(orchestrator: Orchestrator, readiness: Readiness, *, model: str) -> None:
    """One short request through both legs; records in ``readiness`` whether it went through."""
    request_id = f"warm-up-{uuid.uuid4().hex[:12]}"
    call = Call(path=WARM_UP_PATH, body={"model": model, "prompt": "warm up", "max_tokens": 2},
                request_id=request_id, mode=Mode.PD, arrived_s=time.perf_counter(), may_prefill_locally=False)
    try:
        reply = await orchestrator.run(call)
    except PdserveError as exc:
        readiness.warm_up, readiness.warm_up_error = WarmUp.FAILED, client_error(exc, request_id=request_id).message
        log.warning("request_id=%s warm-up through both legs failed: %s", request_id, exc)
        return
    reply.close()
    readiness.warm_up = WarmUp.DONE
    log.info("request_id=%s warm-up through both legs done: ready", request_id)
