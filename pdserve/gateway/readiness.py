"""Readiness that means ready: engines of both roles answer their health probes, one request has gone
through both legs since, and one through every (prefill, decode) pair, so no user pays a pair's KV connector
handshake (seconds for NIXL on a GPU) on an engine the first warm-up missed; then a chat through each pair, so the
first clients' chats do not pay a chat's first use on any engine.

The gateway sends the warm-ups itself, so ``pdserve up``, Ray and Kubernetes all become ready the same
way; their callers only wait for ``/health/ready``. A pair that appears later (an engine added or back)
is warmed at the next look, without making the gateway unready.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pdserve.engine_config import KVTransferSpec
from pdserve.errors import LegFailed, PdserveError, UpstreamRejected
from pdserve.gateway.call import Call
from pdserve.gateway.client_errors import client_error
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.pd import resume
from pdserve.pd.engine_http import EngineClient
from pdserve.pd.pair import send_through_pair
from pdserve.role import Role
from pdserve.routing.decision import Mode
from pdserve.routing.health import next_look_s
from pdserve.routing.pool import Pool

log = logging.getLogger(__name__)
Pair = tuple[str, str]  # (prefill engine URL, decode engine URL)
# A first handshake between two engines takes seconds (NIXL on a GPU); a CPU engine busy compiling, longer.
PAIR_WARM_UP_TIMEOUT_S = 120.0
WarmPair = Callable[[Pair, dict[str, Any], str], Awaitable[object]]  # (pair, body, request id): raises LegFailed


class WarmUp(StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"  # the last attempt failed; another follows


@dataclass(slots=True)
class Readiness:
    """The warm-up's state; the gateway is ready while it is done and both roles have engines."""

    warm_up: WarmUp = WarmUp.PENDING
    warm_up_error: str = ""  # what a client would have been told: no engine address
    warm_pairs: set[Pair] = field(default_factory=set)  # pairs a warm-up went through, while both stay healthy

    def report(self, pool: Pool) -> tuple[bool, dict[str, Any]]:
        """(is ready, the body /health/ready answers with)."""
        counts = {role.value: len(pool.healthy(role)) for role in Role}
        pairs = healthy_pairs(pool)
        is_ready = self.warm_up is WarmUp.DONE and all(counts.values())
        body: dict[str, Any] = {"status": "ready" if is_ready else "not_ready", "healthy_engines": counts,
                                "warm_up": self.warm_up.value, "warm_pairs": f"{len(pairs & self.warm_pairs)}/{len(pairs)}"}
        if self.warm_up is WarmUp.FAILED or (self.warm_up_error and pairs - self.warm_pairs):
            body["warm_up_error"] = self.warm_up_error
        return is_ready, body


def pair_warmer(client: EngineClient, *, kv: KVTransferSpec, timeout_s: float = PAIR_WARM_UP_TIMEOUT_S) -> WarmPair:
    """Warms one pair by a request straight to its two engines (``pd/pair.py``)."""
    async def warm(pair: Pair, body: dict[str, Any], request_id: str) -> None:
        await send_through_pair(client, prefill_url=pair[0], decode_url=pair[1], body=body, connector=kv.connector,
                                request_id=request_id, timeout_s=timeout_s)
    return warm


def healthy_pairs(pool: Pool) -> set[Pair]:
    return {(prefill.url, decode.url) for prefill in pool.healthy(Role.PREFILL) for decode in pool.healthy(Role.DECODE)}


async def keep_warm(orchestrator: Orchestrator, pool: Pool, readiness: Readiness, *, warm_pair: WarmPair, model: str,
                    interval_s: float) -> None:
    """Forever: once engines of both roles are healthy, send one warm-up request through both legs, then
    one through each pair not yet warmed, every ``interval_s`` until they succeed; after a role had no
    engine at all, again. Ready once the first went through and every pair was tried: a pair that fails
    (a broken engine among several) is retried, counted as a failed leg, and holds nobody up. Until both
    roles have an engine, it looks as often as the health probes do (``health.next_look_s``)."""
    while True:
        if not pool.can_serve:
            if readiness.warm_up is WarmUp.DONE:
                log.warning("a role has no healthy engine: not ready until a new warm-up succeeds")
            readiness.warm_up = WarmUp.PENDING
            await asyncio.sleep(next_look_s(pool, interval_s))
            continue
        if readiness.warm_up is WarmUp.DONE or await warm_up(orchestrator, readiness, model=model):
            await warm_pairs(orchestrator, pool, readiness, warm_pair=warm_pair, model=model)
            readiness.warm_up = WarmUp.DONE
        await asyncio.sleep(interval_s)


async def warm_up(orchestrator: Orchestrator, readiness: Readiness, *, model: str) -> bool:
    """One short request through both legs, as a client's goes; records in ``readiness`` if it failed."""
    call = _warm_up_call(resume.COMPLETIONS_PATH, warm_up_body(model), "warm-up")
    try:
        (await orchestrator.run(call)).close()
    except PdserveError as exc:
        readiness.warm_up = WarmUp.FAILED
        readiness.warm_up_error = client_error(exc, request_id=call.request_id).message
        log.warning("request_id=%s warm-up through both legs failed: %s", call.request_id, exc)
        return False
    log.info("request_id=%s warm-up through both legs done", call.request_id)
    return True


async def warm_chat(orchestrator: Orchestrator, *, model: str) -> None:
    """A streamed chat through both legs (of one pair: ``Orchestrator.on_pair``), read to its end: a chat's legs ask
    the engines for what a completion's do not (the prompt's ids, a hybrid's logprobs), and on a GPU the first chats
    after start waited 1.5-2.2 s on the prefill engine (docs/benchmarks.md section 8). Never holds readiness back:
    the completion proved both legs, and a model without a chat template refuses every chat (a 4xx, as it will
    refuse clients')."""
    call = _warm_up_call(resume.CHAT_PATH, chat_warm_up_body(model), "warm-up-chat")
    try:
        reply = await orchestrator.run(call)
        try:
            if reply.stream is not None:
                async for _ in reply.stream(None):
                    pass
        finally:
            reply.close()
    except UpstreamRejected as exc:
        log.info("request_id=%s no chat warm-up: %s (%s)", call.request_id, exc, exc.body[:200].decode(errors="replace"))
        return
    except PdserveError as exc:
        log.warning("request_id=%s chat warm-up through both legs failed: %s; clients' chats may too", call.request_id,
                    exc)
        return
    log.info("request_id=%s chat warm-up through both legs done", call.request_id)


def _warm_up_call(path: str, body: dict[str, Any], prefix: str) -> Call:
    """A warm-up as the orchestrator takes a client's request, but PD only: it is there to prove both legs."""
    return Call(path=path, body=body, request_id=f"{prefix}-{uuid.uuid4().hex[:12]}", mode=Mode.PD,
                arrived_s=time.perf_counter(), may_prefill_locally=False)


async def warm_pairs(orchestrator: Orchestrator, pool: Pool, readiness: Readiness, *, warm_pair: WarmPair,
                     model: str) -> None:
    """Send a warm-up through every healthy pair not yet warmed, all at once, then a chat through each that went
    through. A pair whose engine went unhealthy is forgotten: it is warmed again when back (a restarted engine
    handshakes anew, and an engine added by ``scale`` has had no chat)."""
    pairs = healthy_pairs(pool)
    readiness.warm_pairs &= pairs
    cold = sorted(pairs - readiness.warm_pairs)
    await asyncio.gather(*(_warm_one(pair, orchestrator, pool, readiness, warm_pair=warm_pair, model=model)
                           for pair in cold))


async def _warm_one(pair: Pair, orchestrator: Orchestrator, pool: Pool, readiness: Readiness, *,
                    warm_pair: WarmPair, model: str) -> None:
    request_id = f"warm-up-pair-{uuid.uuid4().hex[:12]}"
    try:
        await warm_pair(pair, warm_up_body(model), request_id)
    except LegFailed as exc:
        url = pair[0] if exc.role is Role.PREFILL else pair[1]
        for endpoint in [endpoint for endpoint in pool.all(exc.role) if endpoint.url == url]:
            # as a client's failed leg: counted, and the circuit breaker told
            orchestrator.leg_failed(endpoint, request_id, exc, is_unreachable=exc.status is None)
        readiness.warm_up_error = client_error(exc, request_id=request_id).message
        log.warning("request_id=%s warm-up of the pair %s -> %s failed: %s", request_id, *pair, exc)
        return
    readiness.warm_pairs.add(pair)
    log.info("request_id=%s warm-up of the pair %s -> %s done", request_id, *pair)
    await warm_chat(orchestrator.on_pair(prefill_url=pair[0], decode_url=pair[1]), model=model)


def warm_up_body(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "warm up", "max_tokens": 2}


def chat_warm_up_body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2, "stream": True}
