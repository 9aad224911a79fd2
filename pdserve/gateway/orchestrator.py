"""One request end to end: choose engines, run the prefill leg, run the decode leg, relay.

Knows nothing of HTTP servers: it gets a validated body and returns a Reply. Errors are raised
(see errors.py) until the first byte is relayed; after that a stream ends with one SSE error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from pdserve.config import GatewaySpec
from pdserve.errors import LegFailed, NoHealthyEndpoint
from pdserve.gateway.admission import Admission
from pdserve.gateway.handoffs import Handoffs
from pdserve.gateway.metrics import GatewayMetrics, ModeMetrics
from pdserve.pd import decode, legs, prefill
from pdserve.pd.engine_http import EngineClient, EngineReply, EngineUnreachable
from pdserve.pd.kv import KVTransferParams
from pdserve.protocol import sse_error_event
from pdserve.role import Role
from pdserve.routing.policy import Policy
from pdserve.routing.pool import Endpoint, Pool

log = logging.getLogger(__name__)
T = TypeVar("T")


class Mode(StrEnum):
    PD = "pd"  # prefill engine, then decode engine
    LOCAL = "local"  # the decode engine does both phases (diagnosis, comparison)


@dataclass(frozen=True, slots=True)
class Call:
    """What the orchestrator needs to know about one client request."""

    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]
    request_id: str
    mode: Mode
    arrived_s: float  # time.perf_counter() at arrival

    @property
    def is_stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass(frozen=True, slots=True)
class Reply:
    """Either a whole JSON body or a stream of SSE bytes (exactly one is set).

    ``close`` must be called once the stream is done or abandoned: a stream that was never
    iterated (client gone before the first byte) cannot clean up after itself.
    """

    json_body: bytes | None = None
    stream: AsyncIterator[bytes] | None = None
    close: Callable[[], None] = lambda: None


class Orchestrator:
    def __init__(
        self, *, client: EngineClient, pool: Pool, admission: Admission, policy: Policy,
        spec: GatewaySpec, connector: str, metrics: GatewayMetrics, handoffs: Handoffs,
    ) -> None:
        self._client, self._pool, self._admission, self._policy = client, pool, admission, policy
        self._spec, self._connector, self._metrics, self._handoffs = spec, connector, metrics, handoffs

    async def run(self, call: Call) -> Reply:
        """Serve ``call``: returns once the decode engine has accepted the request."""
        decode_body, prefill_done_s = call.body, None
        if call.mode is Mode.PD:
            kv = await self._run_prefill(call)
            decode_body, prefill_done_s = decode.make_body(call.body, kv), time.perf_counter()
        stack = ExitStack()
        try:
            endpoint, response = await self._failover(
                Role.DECODE, call.request_id, stack,
                lambda url: decode.open_stream(self._client, url + call.path, decode_body, request_id=call.request_id,
                                               idle_timeout_s=self._spec.decode_idle_timeout_s),
            )
        except BaseException:
            stack.close()
            raise
        relay = _Relay(call, endpoint, response, stack, self._metrics, prefill_done_s, self._spec, self._handoffs)
        if call.is_stream:
            return Reply(stream=relay.stream(), close=relay.finish)
        return Reply(json_body=await relay.read_whole())

    async def _run_prefill(self, call: Call) -> KVTransferParams:
        body = prefill.make_body(call.body, connector=self._connector)
        with ExitStack() as stack:
            _, kv = await self._failover(
                Role.PREFILL, call.request_id, stack,
                lambda url: prefill.run(self._client, url + call.path, body,
                                        request_id=call.request_id, timeout_s=self._spec.prefill_timeout_s),
            )
        elapsed_s = time.perf_counter() - call.arrived_s
        self._metrics.legs[Role.PREFILL].observe(elapsed_s)
        # Written once the decode leg is on its way: a log line costs ~0.1 ms of the loop under
        # load (record, format, write), which the decode leg, and so the first token, would wait for.
        asyncio.get_running_loop().call_soon(
            log.info, "request_id=%s role=prefill status=200 elapsed_ms=%.1f prompt_tokens=%d kv_blocks=%d",
            call.request_id, elapsed_s * 1000, kv.prompt_tokens, kv.block_count,
        )
        return kv

    async def _failover(
        self, role: Role, request_id: str, stack: ExitStack, attempt: Callable[[str], Awaitable[T]]
    ) -> tuple[Endpoint, T]:
        """Run ``attempt`` on a chosen endpoint; on LegFailed try the next healthy one.

        Safe because a failed leg produced nothing the client saw. While every candidate is at
        ``max_in_flight_per_engine``, waits in line (raises Overloaded past the queue's bounds).
        The chosen endpoint's engine slot is held on ``stack`` until the caller closes it.
        """
        tried: list[Endpoint] = []
        last_error: LegFailed | None = None
        for _ in range(self._spec.leg_attempts):
            candidates = await self._admission.engines_with_room(
                role, lambda: [endpoint for endpoint in self._pool.healthy(role) if endpoint not in tried])
            if not candidates:
                break
            endpoint = self._policy.choose(candidates)
            tried.append(endpoint)
            with ExitStack() as attempt_stack:
                attempt_stack.enter_context(self._admission.engine_slot(endpoint))
                try:
                    result = await attempt(endpoint.url)
                except LegFailed as exc:
                    self._metrics.leg_failures.labels(role.value).inc()
                    if exc.status is None:
                        endpoint.is_healthy = False  # unreachable: skip it until /health answers
                    log.warning("request_id=%s role=%s endpoint=%s leg failed: %s",
                                request_id, role.value, endpoint.url, exc)
                    last_error = exc
                    continue
                stack.enter_context(attempt_stack.pop_all())
                return endpoint, result
        if last_error is not None:
            raise last_error
        raise NoHealthyEndpoint(role)


class _Relay:
    """Relays the decode engine's reply to the client and records its timing."""

    def __init__(
        self, call: Call, endpoint: Endpoint, response: EngineReply, stack: ExitStack,
        metrics: GatewayMetrics, prefill_done_s: float | None, spec: GatewaySpec, handoffs: Handoffs,
    ) -> None:
        self._call, self._endpoint, self._response, self._stack = call, endpoint, response, stack
        self._metrics, self._prefill_done_s = metrics, prefill_done_s
        self._handoffs, self._idle_timeout_s = handoffs, spec.decode_idle_timeout_s
        self._mode: ModeMetrics = metrics.modes[call.mode.value]
        self._is_finished = False

    async def read_whole(self) -> bytes:
        try:
            payload = await self._response.read(idle_timeout_s=self._idle_timeout_s)
        except (EngineUnreachable, TimeoutError) as exc:
            raise legs.leg_failed(Role.DECODE, self._endpoint.url, exc, status=200,
                                  timeout_s=self._idle_timeout_s) from exc
        finally:
            self.finish()
        self._mode.ttft.observe(time.perf_counter() - self._call.arrived_s)
        return payload

    async def stream(self) -> AsyncIterator[bytes]:
        """Pass the engine's SSE bytes through untouched, chunk by chunk, as they arrive."""
        # Per chunk: one clock read and one lock-free histogram count (gateway/token_gaps.py).
        observe_gap, previous_s = self._mode.itl.observe, None
        try:
            async for chunk in self._response.chunks(idle_timeout_s=self._idle_timeout_s):
                now_s = time.perf_counter()
                if previous_s is None:
                    self._first_token(now_s)
                else:
                    observe_gap(now_s - previous_s)
                previous_s = now_s
                yield chunk
        except (EngineUnreachable, TimeoutError) as exc:
            log.error("request_id=%s role=decode endpoint=%s stream broke: %r",
                      self._call.request_id, self._endpoint.url, exc)
            yield sse_error_event(f"the decode engine's stream broke (request id {self._call.request_id})",
                                  code="decode_stream_failed")
        finally:
            self.finish()

    def _first_token(self, now_s: float) -> None:
        self._mode.ttft.observe(now_s - self._call.arrived_s)
        if self._prefill_done_s is None:
            return
        handoff_s = now_s - self._prefill_done_s
        self._metrics.kv_handoff.observe(handoff_s)
        self._metrics.legs[Role.DECODE].observe(handoff_s)
        # Slow or not is judged later against the engine's own transfer times (kv_monitor.py):
        # a handoff also waits in a busy decode engine's queue, which is load, not the transport.
        self._metrics.kv_handoff_queue.observe(self._handoffs.record(self._endpoint.url, handoff_s))

    def finish(self) -> None:
        """Close the upstream reply and record the request; idempotent."""
        if self._is_finished:
            return
        self._is_finished = True
        elapsed_s = time.perf_counter() - self._call.arrived_s
        self._mode.e2e.observe(elapsed_s)
        self._response.close()  # an unfinished upstream sees the disconnect and aborts
        self._stack.close()
        log.info("request_id=%s role=decode endpoint=%s status=200 elapsed_ms=%.1f",
                 self._call.request_id, self._endpoint.url, elapsed_s * 1000)
