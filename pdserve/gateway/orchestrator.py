"""One request end to end: choose engines, run the prefill leg, run the decode leg, relay.

Knows nothing of HTTP servers: it gets a validated body and returns a Reply. Errors are raised
(see errors.py) until the first byte is relayed; after that a stream ends with one SSE error.

What a fault costs the client (docs/reliability.md):
1. Prefill fails on every engine tried: the decode engine prefills the prompt itself (local).
2. The decode engine fails before its first byte: the prompt goes to another decode engine, local.
3. It fails mid-stream: another decode engine continues from the text already sent (pd/resume.py),
   where that keeps the distribution; otherwise one SSE error event.
4. A handoff no decode engine was ever sent is given back (pd/decode.release_kv), so the prefill
   engine frees its blocks at once, not when the connector's lease runs out (docs/reliability.md,
   "Cancellation").
Engines that keep failing leave the rotation for a while (routing/breaker.py).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack
from dataclasses import replace
from typing import Any, TypeVar

from pdserve.errors import LegFailed, NoHealthyEndpoint
from pdserve.gateway import whole_pull
from pdserve.gateway.admission import Admission
from pdserve.gateway.call import Call, Reply
from pdserve.gateway.decode_leg import DecodeLeg
from pdserve.gateway.handoffs import Handoffs
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.recent import RecentRequests, never_answered
from pdserve.gateway.relay import Relay
from pdserve.gateway.tenants import hide_cached_tokens
from pdserve.gateway.tracing import LegTrace
from pdserve.gateway_config import GatewaySpec
from pdserve.pd import decode, first_delta, first_events, first_token, kv_proof, prefill, resume
from pdserve.pd.engine_http import EngineClient
from pdserve.pd.engine_reply import EngineReply
from pdserve.pd.first_token import FirstToken, Reason
from pdserve.pd.kv import KVTransferParams
from pdserve.pd.kv_proof import KvOutcome, RecomputeReason
from pdserve.pd.lead import Lead, forced_body, make_lead
from pdserve.pd.native_relay import NativeRelay
from pdserve.role import Role
from pdserve.routing import breaker
from pdserve.routing.decision import Mode
from pdserve.routing.health import WAITING_PROBE_INTERVAL_S
from pdserve.routing.policy import Policy
from pdserve.routing.pool import Endpoint, Engines, PairOnly, Pool
from pdserve.routing.prefix import PromptKey
from pdserve.routing.router import KeyedPolicy, Router

log = logging.getLogger(__name__)
T = TypeVar("T")


class Orchestrator:
    def __init__(
        self, *, client: EngineClient, pool: Pool, admission: Admission, router: Router,
        spec: GatewaySpec, connector: str, metrics: GatewayMetrics, handoffs: Handoffs,
        recent: RecentRequests | None = None, max_model_len: Callable[[], int | None] = lambda: None,
        native: NativeRelay | None = None, decode_forces_first_token: bool = False, engines_parse_chat: bool = False,
        tool_call_parser: str | None = None, hides_cached_tokens: bool = False,
    ) -> None:
        """``max_model_len``: the engines' context length, once known (gateway/model_card.py).
        ``native``: the relay thread streams go to after their first token (pd/native_relay.py), if any.
        ``decode_forces_first_token``, ``engines_parse_chat``: what the engines can do with the prefill engine's
        token (engine_config.py's PoolSpec.forces_first_token, parses_chat; pd/first_token.py); ``tool_call_parser``:
        the one they run (pd/first_delta.py). ``hides_cached_tokens``: clients get usage without them (gateway/tenants.py)."""
        self._decode_forces_first_token, self._engines_parse_chat = decode_forces_first_token, engines_parse_chat
        self._tool_call_parser, self._hides_cached_tokens = tool_call_parser, hides_cached_tokens
        self._client, self._pool, self._admission, self._router = client, pool, admission, router
        self._routable: Engines = pool  # what it routes among: the pool, or one pair of it (on_pair)
        self._max_model_len, self._native = max_model_len, native
        self._spec, self._connector, self._metrics, self._handoffs = spec, connector, metrics, handoffs
        self._releases: set[asyncio.Task[None]] = set()  # handoffs being given back (owned: see close)
        self._said_whole_prompt_refused = False  # the warning that prefill engines cut hybrid prompts short, once
        self.recent = RecentRequests() if recent is None else recent  # what the live page lists

    async def run(self, call: Call) -> Reply:
        """Serve ``call``: returns once the decode engine has accepted the request, or, when the
        prefill engine's token leads the reply, once a decode engine with room is being asked.

        The decode engine is chosen first (routing/router.py: its load against the prompt's
        cached prefix); then whether a prefill engine computes the prompt, or that decode engine.
        """
        key = call.prompt_key or self._router.key(call.body)
        preferred = self._choose_decode(key)
        prefill_engines = self._routable.healthy(Role.PREFILL)
        decision = self._router.decide(key, preferred, prefill=prefill_engines, requested=call.mode)
        decode_policy = KeyedPolicy(self._router, key, preferred=preferred)
        self._metrics.disaggregation_decisions.labels(decision.mode.value, decision.reason.value).inc()
        reason = self._why_not_first_token(call)
        kv = await self._prefill_or_local(call, key, reason is None) if decision.mode is Mode.PD else None
        prefill_done_s = None if kv is None else time.perf_counter()
        first = self._first_token(call, kv, reason)
        made: tuple[dict[str, Any], Lead] | Reason = first if isinstance(first, Reason) else Reason.LOCAL
        if isinstance(first, FirstToken):
            assert kv is not None, "a token comes with its handoff"
            if first.finish_reason is not None:  # the prefill engine's token is the whole reply
                self._release(kv, call.request_id)
                return self._first_token_only(call, first)
            made = make_lead(call.body, first, kv, path=call.path)
        self._count_first_token(call, made if isinstance(made, Reason) else Reason.ELIGIBLE)
        lead = None
        if isinstance(made, Reason) and kv is not None and kv.is_whole_prompt:
            if isinstance(kv.first, FirstToken) and first_token.is_forced(call.body, path=call.path):
                decode_body = forced_body(call.body, kv.first, kv)  # the token from the decode engine, as one writes it
            else:  # a hybrid's state after the whole prompt lines up with no other decode leg: prefill again
                self._release(kv, call.request_id)
                kv = None
                decode_body = call.body
        elif isinstance(made, Reason):
            decode_body = call.body if kv is None else decode.make_body(call.body, kv)
        else:
            decode_body, lead = made
        tried: list[Endpoint] = []

        async def open_leg(*, over_cap: bool = False) -> DecodeLeg:
            try:  # over_cap: behind a lead the client has, so it waits for a decode engine to recover too
                leg = await self._open_decode(call, decode_body, tried, decode_policy, over_cap=over_cap,
                                              wait=over_cap)
            except BaseException:
                if kv is not None and not tried:  # no decode engine ever saw this handoff
                    self._release(kv, call.request_id)
                raise
            self._router.record(key, leg.endpoint)
            return leg

        # The client has its first token while the decode leg opens, where a decode engine has room
        # now (it was admitted: over_cap); else the leg opens first, so a full pool still answers 429.
        # Nothing else there refuses what the prefill engine took: vLLM caps max_tokens at the context
        # left (get_max_tokens, vLLM 0.26 and 0.32) rather than refusing it.
        def reopen(body: dict[str, Any], again: Endpoint | None = None, *, wait: bool = True) -> Awaitable[DecodeLeg]:
            """``body`` on a decode engine not tried yet, or ``again`` (its pull was lost, not its fault)."""
            if again is not None and again in tried:
                tried.remove(again)
            return self._open_decode(call, body, tried, decode_policy, over_cap=True, wait=wait)

        leg: DecodeLeg | asyncio.Task[DecodeLeg]
        is_pull_lost = False
        if lead is not None and self._admission.has_room(self._routable.healthy(Role.DECODE)):
            leg = asyncio.create_task(open_leg(over_cap=True))
        else:
            try:
                if call.is_stream or kv is None:
                    leg = await open_leg()
                else:  # a whole PD reply: a hung pull is told from the decode engine's count (whole_pull.py)
                    leg, is_pull_lost = await whole_pull.first_whole(
                        asyncio.create_task(open_leg()), pull_timeout_s=self._spec.kv_pull_timeout_s,
                        is_pull_pending=lambda: bool(tried) and tried[-1].load.kv_pulls_pending > 0,
                        local=lambda: reopen(call.body, tried[-1]))
            except (LegFailed, NoHealthyEndpoint):
                self.recent.add(never_answered(call, kv, elapsed_s=time.perf_counter() - call.arrived_s))
                raise
        if is_pull_lost:
            assert kv is not None and isinstance(leg, DecodeLeg)
            self.kv_judged(kv, call.request_id, outcome=KvOutcome.RECOMPUTED, reason=RecomputeReason.PULL_TIMEOUT,
                           decode_url=leg.endpoint.url)

        mode = Mode.PD if kv is not None else Mode.LOCAL
        relay = Relay(call, leg, mode=mode, prefill_done_s=prefill_done_s, kv=kv,
                      is_pull_lost=is_pull_lost, lead=lead, reopen=reopen,
                      leg_failed=self.leg_failed, kv_judged=self.kv_judged, spec=self._spec, metrics=self._metrics, handoffs=self._handoffs,
                      recent=self.recent, native=self._native, hides_cached_tokens=self._hides_cached_tokens)
        if call.is_stream:
            return Reply(stream=relay.stream, close=relay.finish, first_chunk_ready=lead is not None, mode=mode)
        return Reply(json_body=await relay.read_whole(), mode=mode)

    def on_pair(self, *, prefill_url: str, decode_url: str) -> Orchestrator:
        """This orchestrator with its routing held to one (prefill, decode) pair, all else shared (engine slots,
        circuit breaker, metrics): the gateway's warm-up of each pair's chats goes as a client's chat does."""
        pinned = copy.copy(self)
        pinned._routable = PairOnly(self._pool, prefill_url=prefill_url, decode_url=decode_url)
        return pinned

    async def close(self) -> None:
        """Cancel the handoffs still being given back (gateway shutdown)."""
        for task in self._releases:
            task.cancel()
        await asyncio.gather(*self._releases, return_exceptions=True)

    def _why_not_first_token(self, call: Call) -> Reason | None:
        """Why ``call`` is not to get the prefill engine's token first; None: it is, if the prefill leg gives it."""
        if not self._spec.first_token_from_prefill:
            return Reason.SETTING_OFF
        return first_token.why_not(call.body, path=call.path, is_stream=call.is_stream,
                                   decode_forces=self._decode_forces_first_token, parses_chat=self._engines_parse_chat)

    def _first_token(self, call: Call, kv: KVTransferParams | None, reason: Reason | None) -> FirstToken | Reason:
        """The prefill engine's token as ``call`` ends it, or why the decode engine's comes first."""
        if reason is not None:
            return reason
        if kv is None or kv.first is None:
            return Reason.LOCAL
        if isinstance(kv.first, Reason):
            if kv.first is Reason.PREFILL_STOPPED_SHORT and not first_token.is_forced(call.body, path=call.path):
                self._say_whole_prompt_refused(kv)
            return kv.first
        first = first_token.for_client(call.body, kv.first, path=call.path, max_model_len=self._max_model_len())
        if call.path != resume.CHAT_PATH or not self._engines_parse_chat:
            return first
        return first_delta.parsed_delta(call.body, first, tool_call_parser=self._tool_call_parser)

    def _say_whole_prompt_refused(self, kv: KVTransferParams) -> None:
        """Once: a prefill engine asked for a hybrid's whole prompt computed it a token short, so such requests get
        the decode engine's first token (the engine runs vLLM's own connector, or one pdserve_vllm cannot change)."""
        if not self._said_whole_prompt_refused:
            self._said_whole_prompt_refused = True
            log.warning("prefill engine %s stops a hybrid model's prompts a token short although asked for the whole "
                        "prompt: it does not load pdserve_vllm.hybrid_connector, or that cannot change its vLLM's "
                        "NixlConnector (its log says); such requests get the decode engine's first token",
                        kv.prefill_url)

    def _count_first_token(self, call: Call, reason: Reason) -> None:
        source = Role.PREFILL if reason is Reason.ELIGIBLE else Role.DECODE
        self._metrics.first_tokens.labels(call.path, source.value, reason.value).inc()

    def _first_token_only(self, call: Call, first: FirstToken) -> Reply:
        """The reply when the prefill engine's token ends it (a stop token, or max_tokens 1)."""
        ending = first_events.ending(call.body, first, path=call.path)
        if call.on_usage is not None and (usage := kv_proof.usage_of_events(ending)) is not None:
            call.on_usage(usage)
        chunks = (first_events.token_events(call.body, first, path=call.path, text=first.text),
                  hide_cached_tokens(ending) if self._hides_cached_tokens else ending)
        self._count_first_token(call, Reason.ELIGIBLE)

        async def stream(_write_now: object = None) -> AsyncIterator[bytes]:
            elapsed_s = time.perf_counter() - call.arrived_s
            self._metrics.modes[Mode.PD.value].ttft.observe(elapsed_s)
            self._metrics.modes[Mode.PD.value].e2e.observe(elapsed_s)
            log.info("request_id=%s mode=pd status=200 elapsed_ms=%.1f ttft_ms=%.1f finish_reason=%s (the prefill "
                     "engine's token)", call.request_id, elapsed_s * 1000, elapsed_s * 1000, first.finish_reason)
            for chunk in chunks:
                yield chunk

        return Reply(stream=stream, close=lambda: None, first_chunk_ready=True, mode=Mode.PD)

    def _choose_decode(self, key: PromptKey) -> Endpoint:
        """The decode engine the router prefers for this prompt, among those with room if any has.
        Waiting for room, if it comes to that, happens once the prompt is prefilled (``_failover``)."""
        healthy = self._routable.healthy(Role.DECODE)
        if not healthy:
            raise NoHealthyEndpoint(Role.DECODE)
        limit = self._spec.max_in_flight_per_engine
        return self._router.choose(key, [endpoint for endpoint in healthy if endpoint.in_flight < limit] or healthy)

    async def _prefill_or_local(self, call: Call, key: PromptKey, wants_first_token: bool) -> KVTransferParams | None:
        """The prefill leg's KV parameters; None when no prefill engine could prefill and the
        decode engine is to do it itself (``local_fallback``)."""
        try:
            return await self._run_prefill(call, key, wants_first_token)
        except (LegFailed, NoHealthyEndpoint) as exc:
            if not (self._spec.local_fallback and call.may_prefill_locally):
                raise
            reason = "no_prefill_engine" if isinstance(exc, NoHealthyEndpoint) else (
                "prefill_timeout" if exc.is_timeout else "prefill_failed")
            self._metrics.local_fallbacks.labels(reason).inc()
            log.warning("request_id=%s no prefill engine could prefill (%s): the decode engine prefills it",
                        call.request_id, reason)
            return None

    async def _run_prefill(self, call: Call, key: PromptKey, wants_first_token: bool) -> KVTransferParams:
        body = prefill.make_body(call.body, connector=self._connector, wants_first_token=wants_first_token,
                                 wants_whole_prompt=wants_first_token,
                                 wants_restore_last=wants_first_token and first_token.is_forced(call.body,
                                                                                                 path=call.path))

        async def attempt(endpoint: Endpoint) -> KVTransferParams:
            trace = call.trace.leg(Role.PREFILL, endpoint.url)
            with self._router.prefilling(key, endpoint), trace.attempt():
                kv = await prefill.run(self._client, endpoint.url + call.path, body, request_id=call.request_id,
                                       timeout_s=self._spec.prefill_timeout_s, trace_headers=trace.headers,
                                       wants_first_token=wants_first_token)
            trace.prefilled(kv)
            return kv

        with ExitStack() as stack:
            endpoint, kv = await self._failover(Role.PREFILL, call.request_id, stack, [], KeyedPolicy(self._router, key),
                                                attempt)
        self._router.record(key, endpoint)
        self._metrics.legs[Role.PREFILL].observe(time.perf_counter() - call.arrived_s)
        # The request's log line names the engine (relay.py); its block size maps the blocks (first_token.py).
        return replace(kv, prefill_url=endpoint.url, block_size=int(endpoint.load.block_size))

    async def _open_decode(self, call: Call, body: dict[str, Any], tried: list[Endpoint], policy: Policy, *,
                           over_cap: bool = False, wait: bool = False) -> DecodeLeg:
        """Send ``body`` to a decode engine not in ``tried`` (which grows by each one tried);
        ``over_cap`` for a request moving off a failed one (``Admission.engines_with_room``);
        ``wait``: with none healthy, wait as long as for a first token for one to recover.

        A stream waits at most ``first_token_timeout_s`` for its headers; a whole reply, whose
        headers come with its last token, until the request's deadline.
        """
        def timeout_s() -> float:
            left_s = call.time_left_s(self._spec)
            return min(left_s, self._spec.first_token_timeout_s) if call.is_stream else left_s

        stack = ExitStack()

        async def attempt(endpoint: Endpoint) -> tuple[EngineReply, LegTrace]:
            trace = call.trace.leg(Role.DECODE, endpoint.url)
            with trace.attempt():
                return await decode.open_stream(self._client, endpoint.url + call.path, body, request_id=call.request_id,
                                                timeout_s=timeout_s(), trace_headers=trace.headers), trace

        try:
            endpoint, (response, trace) = await self._failover(Role.DECODE, call.request_id, stack, tried, policy,
                                                               attempt, over_cap=over_cap,
                                                               wait_s=timeout_s() if wait else 0.0)
        except BaseException:
            stack.close()
            raise
        return DecodeLeg(endpoint, response, stack, trace)

    async def _failover(
        self, role: Role, request_id: str, stack: ExitStack, tried: list[Endpoint], policy: Policy,
        attempt: Callable[[Endpoint], Awaitable[T]], *, over_cap: bool = False, wait_s: float = 0.0,
    ) -> tuple[Endpoint, T]:
        """Run ``attempt`` on the endpoint ``policy`` chooses among those not in ``tried``; on
        LegFailed try the next healthy one; with none left, wait up to ``wait_s`` for one to recover.

        Safe because a failed leg produced nothing the client saw. While every candidate is at
        ``max_in_flight_per_engine``, waits in line (raises Overloaded past the queue's bounds), unless ``over_cap``.
        The chosen endpoint's engine slot is held on ``stack`` until the caller closes it.
        """
        def untried() -> list[Endpoint]:
            return [endpoint for endpoint in self._routable.healthy(role) if endpoint not in tried]

        last_error: LegFailed | None = None
        for _ in range(self._spec.leg_attempts):
            candidates = await self._admission.engines_with_room(role, untried, over_cap=over_cap)
            if not candidates and wait_s > 0 and await self._one_recovers(role, request_id, tried, untried,
                                                                          wait_s=wait_s):
                wait_s = 0.0
                candidates = await self._admission.engines_with_room(role, untried, over_cap=over_cap)
            if not candidates:
                break
            endpoint = policy.choose(candidates)
            tried.append(endpoint)
            with ExitStack() as attempt_stack:
                attempt_stack.enter_context(self._admission.engine_slot(endpoint))
                try:
                    result = await attempt(endpoint)
                except LegFailed as exc:
                    self.leg_failed(endpoint, request_id, exc, is_unreachable=exc.status is None)
                    last_error = exc
                    continue
                breaker.record_success(endpoint)
                stack.enter_context(attempt_stack.pop_all())
                return endpoint, result
        if last_error is not None:
            raise last_error
        raise NoHealthyEndpoint(role)

    async def _one_recovers(self, role: Role, request_id: str, tried: list[Endpoint],
                            untried: Callable[[], list[Endpoint]], *, wait_s: float) -> bool:
        """Whether an engine of ``role`` not in ``tried``, unhealthy or ejected now, is back (``untried``) within ``wait_s``.
        A request the client has part of waits for it rather than ending: on a starved host a busy engine
        misses its health probes for seconds and is back the next moment (tests/e2e/test_faults.py)."""
        if all(endpoint in tried for endpoint in self._routable.all(role)):
            return False
        log.warning("request_id=%s no healthy %s engine left to take the request: waiting up to %.0f s for one "
                    "to recover", request_id, role.value, wait_s)
        deadline_s = time.monotonic() + wait_s
        while (left_s := deadline_s - time.monotonic()) > 0:
            await asyncio.sleep(min(left_s, WAITING_PROBE_INTERVAL_S))  # the probe's pace while a role has none
            if untried():
                return True
        return False

    def kv_judged(self, kv: KVTransferParams, request_id: str, *, outcome: KvOutcome,
                  reason: RecomputeReason | None, decode_url: str) -> None:
        """One handoff's outcome (pd/kv_proof.py): a recompute is counted, logged and fed to the
        prefill engine's breaker (routing/breaker.py), so pairs whose pulls fail stop getting requests."""
        prefill = next((endpoint for endpoint in self._pool.all(Role.PREFILL) if endpoint.url == kv.prefill_url), None)
        if outcome is KvOutcome.PULLED and prefill is not None:
            breaker.record_pulled(prefill)
        if outcome is not KvOutcome.RECOMPUTED or reason is None:
            return
        self._metrics.kv_recomputed.labels(reason.value).inc()
        log.warning("request_id=%s KV NOT PULLED (%s): decode engine %s computed the prompt prefill engine %s "
                    "had computed; check the link between them", request_id, reason.value, decode_url, kv.prefill_url)
        if prefill is not None and breaker.record_failed_pull(prefill, spec=self._spec, now_s=time.monotonic()):
            self._metrics.ejections.labels(Role.PREFILL.value).inc()

    def leg_failed(self, endpoint: Endpoint, request_id: str, exc: Exception, *, is_unreachable: bool) -> None:
        """Count, log and feed the circuit breaker one failed leg."""
        self._metrics.leg_failures.labels(endpoint.role.value).inc()
        if is_unreachable:
            endpoint.is_healthy = False  # skip it until /health answers
        if breaker.record_failure(endpoint, spec=self._spec, now_s=time.monotonic()):
            self._metrics.ejections.labels(endpoint.role.value).inc()
        log.warning("request_id=%s role=%s endpoint=%s leg failed: %s", request_id, endpoint.role.value,
                    endpoint.url, exc)

    def _release(self, kv: KVTransferParams, request_id: str) -> None:
        """Give a handoff back to its prefill engine through a decode engine, in the background."""
        decode_engines = self._routable.healthy(Role.DECODE)
        if not decode_engines:
            return  # the connector's lease frees it
        url = min(decode_engines, key=lambda endpoint: endpoint.in_flight).url
        task = asyncio.create_task(decode.release_kv(self._client, url, kv, request_id=request_id,
                                                     timeout_s=self._spec.connect_timeout_s))
        self._releases.add(task)
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Task[None]) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is None:
            self._metrics.kv_releases.inc()
