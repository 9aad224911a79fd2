"""Relay the decode engine's reply to the client chunk by chunk (or hand it to the relay thread, pd/native_relay.py),
and move it to another decode engine when that one fails (orchestrator.py and docs/reliability.md say when)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from enum import Enum
from typing import Any

from pdserve.errors import LegFailed, PdserveError
from pdserve.gateway.call import Call, ClientSocket
from pdserve.gateway.decode_leg import (
    DecodeLeg,
    EngineErrorEvent,
    KvJudgedHook,
    LegFailedHook,
    Reopen,
    close_opened,
    failed_event_at,
)
from pdserve.gateway.handoffs import Handoffs
from pdserve.gateway.metrics import GatewayMetrics, ModeMetrics
from pdserve.gateway.recent import RecentRequests
from pdserve.gateway.relay_record import RelayRecord
from pdserve.gateway.tenants import hide_cached_tokens
from pdserve.gateway.token_gaps import count_token_events
from pdserve.gateway_config import GatewaySpec
from pdserve.pd import kv_proof, legs, resume
from pdserve.pd.engine_reply import EngineUnreachable
from pdserve.pd.kv import KVTransferParams
from pdserve.pd.kv_proof import KvOutcome, RecomputeReason
from pdserve.pd.lead import USAGE_MARK, Lead, drop_echoed, usage_as_one_engines
from pdserve.pd.native_relay import Handback, NativeRelay, RelayCancelled, Ticket
from pdserve.protocol import SSE_DONE
from pdserve.role import Role
from pdserve.routing.decision import Mode
from pdserve.routing.pool import Endpoint

log = logging.getLogger(__name__)


class Step(Enum):
    """Where a stream goes on after its decode leg failed or fell silent (``Relay._resume``)."""

    MOVED = "moved"  # to another decode engine
    KEPT = "kept"  # on the silent one: no other could take it


class Relay:
    """Relays the decode engine's reply to the client, moves it to another decode engine when
    that engine fails, and records its timing. After the first token a stream's chunks go from the
    engine's socket to the client's in the relay thread (``_hand_over``), or, without it, here (``push``,
    where the server can write at once, else ``stream``): one clock read, one histogram count, one append,
    one write."""

    def __init__(
        self, call: Call, leg: DecodeLeg | asyncio.Task[DecodeLeg], *, mode: Mode, prefill_done_s: float | None,
        kv: KVTransferParams | None, reopen: Reopen, is_pull_lost: bool = False,
        leg_failed: LegFailedHook, kv_judged: KvJudgedHook, spec: GatewaySpec, metrics: GatewayMetrics, handoffs: Handoffs,
        recent: RecentRequests, lead: Lead | None = None, native: NativeRelay | None = None,
        hides_cached_tokens: bool = False,
    ) -> None:
        """``lead``: the prefill engine's token, sent before the decode engine's (pd/first_token.py).
        ``leg``: the decode engine's open reply, or, behind a lead, the task opening it while the lead goes out.
        ``native``: the relay thread that takes the steady part of a stream, or None (every chunk in Python).
        ``is_pull_lost``: the handoff was given up before ``leg`` opened, and counted (gateway/whole_pull.py).
        ``hides_cached_tokens``: the client gets the engine's usage without them (gateway/tenants.py)."""
        self._call, self._reopen, self._leg_failed, self._kv_judged = call, reopen, leg_failed, kv_judged
        self._leg: DecodeLeg | None = leg if isinstance(leg, DecodeLeg) else None
        self._opening = None if isinstance(leg, DecodeLeg) else leg
        self._lead = lead
        # The decode engine's usage is not one engine's behind a lead it had as prompt (it counts it as prompt), nor
        # where cached tokens are shown (it counts the pulled prompt as cached): pd/lead.py rewrites it.
        self._rewrites_usage = lead is not None and not (lead.is_forced and hides_cached_tokens)
        self._hides_cached_tokens = hides_cached_tokens
        # Every usage event must pass here: it is rewritten for the client, or settles the request's tokens.
        self._watches_all_usage = hides_cached_tokens or call.on_usage is not None
        self._echoed_left = 0  # the decode engine's events of a forced lead's token still to drop
        self._spec, self._metrics = spec, metrics
        self._native = native
        self._prefill_done_s = prefill_done_s  # None once the stream moved: no KV handoff to time
        self._kv = kv
        self._mode: ModeMetrics = metrics.modes[mode.value]
        self._sent: list[bytes] = []  # the stream's bytes so far: read back only to resume it
        self._is_finished = False
        # Per-chunk state, shared by the pushed path and the awaited one.
        self._previous_s: float | None = None  # when the last token event went out (the first chunk, at least)
        self._drop_role = False  # a resumed chat stream opens with a role event the client already had
        self._deadline_s = call.arrived_s + spec.request_timeout_s
        self._client: ClientSocket | None = None
        # For the live page's list (gateway/recent.py) and the log line, filled once per request, never per chunk.
        self._record = RelayRecord(call, mode=mode, kv=kv, prefill_done_s=prefill_done_s, metrics=metrics,
                                   handoffs=handoffs, recent=recent)
        # Whether the prompt crossed as KV, from the decode engine's usage (pd/kv_proof.py); None: no handoff.
        self._kv_outcome: KvOutcome | None = None if kv is None else (
            KvOutcome.RECOMPUTED if is_pull_lost else KvOutcome.UNKNOWN)

    async def read_whole(self) -> bytes:
        assert self._leg is not None, "a whole reply has no lead to send while its leg opens"
        try:
            while True:
                try:
                    payload = await self._leg.response.read(idle_timeout_s=self._call.time_left_s(self._spec))
                    self._record.ttft_s = time.perf_counter() - self._call.arrived_s
                    self._call.trace.first_token()
                    payload = self._take_usage(payload, kv_proof.usage_of_reply(payload))
                    break
                except (EngineUnreachable, TimeoutError) as exc:
                    failed = legs.leg_failed(Role.DECODE, self._leg.endpoint.url, exc, status=200,
                                             timeout_s=self._spec.request_timeout_s)
                    self._leg.trace.failed(failed)
                    # Nothing reached the client: another engine may answer the whole request.
                    if isinstance(exc, TimeoutError) or not await self._switch(failed, self._call.body):
                        raise failed from exc
        finally:
            self.finish()
        self._mode.ttft.observe(time.perf_counter() - self._call.arrived_s)
        return payload

    async def stream(self, client: ClientSocket | None = None) -> AsyncIterator[bytes]:
        """Pass the engines' SSE bytes through untouched, chunk by chunk, as they arrive; an engine's
        own error event ends its leg as a broken connection does (the stream moves on, if it can).

        With the ``client`` socket, the chunks after the first go to it from the relay thread
        (``_hand_over``) or from the engine socket's read (``push``); what they cannot take (a slow
        client, the first token, an error event, the deadline, a resumed stream's first chunk)
        comes through here."""
        self._client = client
        sent = self._sent
        push = None if client is None else self.push
        hand_over = None if client is None or self._native is None else self._hand_over
        try:
            if self._lead is not None:
                self._count_tokens(self._lead.events, time.perf_counter())
                self._echoed_left = self._lead.echoed_events
                sent.append(self._lead.events)
                yield self._lead.events
            if self._opening is not None and (ending := await self._opened()) is not None:
                yield ending
                return
            kept_mid_stream = False  # then the engine's next token is waited on as any between two tokens
            while True:
                assert self._leg is not None
                try:
                    async for chunk in self._leg.response.chunks(first_timeout_s=None if kept_mid_stream else (
                                                                     self._first_timeout_s(self._spec.first_token_timeout_s)),
                                                                 idle_timeout_s=self._spec.decode_idle_timeout_s,
                                                                 push=push, hand_over=hand_over):
                        if self._drop_role:
                            chunk, self._drop_role = resume.drop_role_events(chunk), False
                        if self._echoed_left and not (chunk := self._drop_echoed(chunk)):
                            continue
                        if (failed_at := failed_event_at(chunk)) >= 0:  # an error event, or an aborted request
                            raise EngineErrorEvent(chunk[:failed_at], chunk[failed_at:])
                        if self._watches_usage and USAGE_MARK in chunk:
                            chunk = self._take_usage(chunk, kv_proof.usage_of_events(chunk))
                        now_s = time.perf_counter()
                        self._count_tokens(chunk, now_s)
                        if self._prefill_done_s is not None:
                            self._handoff_done(now_s)
                        if now_s > self._deadline_s:
                            yield self._record.error_event("the request ran past its deadline", "request_timeout")
                            return
                        sent.append(chunk)
                        yield chunk
                        if client is not None and client.buffered_bytes > self._spec.max_stream_buffer_bytes:
                            yield self._cut_off(client)
                            return
                    return
                except (EngineUnreachable, TimeoutError) as exc:
                    if isinstance(exc, TimeoutError) and self._prefill_done_s is not None:
                        if not await self._pull_lost():
                            yield self._record.error_event(
                                "the KV pull was lost and no decode engine took the request again", "decode_stream_failed")
                            return
                        self._drop_role = bool(sent) and self._call.path == resume.CHAT_PATH
                        continue
                    is_silent = isinstance(exc, TimeoutError)
                    failure = legs.leg_failed(Role.DECODE, self._leg.endpoint.url, exc, status=200,
                                              timeout_s=self._spec.decode_idle_timeout_s)
                except EngineErrorEvent as exc:  # the request failed there, not in its input: go on elsewhere
                    if exc.before:
                        self._count_tokens(exc.before, time.perf_counter())
                        sent.append(exc.before)
                        yield exc.before
                    is_silent = False
                    failure = LegFailed(Role.DECODE, self._leg.endpoint.url, 200,
                                        f"its stream ended in its own error or abort event {exc}")
                step = await self._resume(failure, is_silent=is_silent)
                if isinstance(step, bytes):
                    yield step
                    return
                kept_mid_stream = step is Step.KEPT and self._previous_s is not None
                if step is Step.MOVED:
                    # A resumed chat opens with a role event the client had; a forced lead's echo drop takes it itself.
                    self._drop_role = bool(sent) and self._call.path == resume.CHAT_PATH and not self._echoed_left
        finally:
            self.finish()

    def push(self, chunk: bytes) -> bool:
        """One chunk straight from the engine's socket to the client's, if nothing but the usual
        per-chunk work is due; False, having done nothing, sends it through ``stream``."""
        previous_s, client = self._previous_s, self._client
        if previous_s is None or client is None or not self._is_steady or failed_event_at(chunk) >= 0 or (
                self._watches_usage and USAGE_MARK in chunk):
            return False
        now_s = time.perf_counter()
        if now_s > self._deadline_s or not client.write_now(chunk):
            return False
        self._count_tokens(chunk, now_s)
        self._sent.append(chunk)
        return True

    def _count_tokens(self, chunk: bytes, now_s: float) -> None:
        """``chunk``'s token events into the record and the inter-token histogram (gateway/token_gaps.py): the
        gap since the last token event for the first of them, 0 for each other; the stream's first has none."""
        events = count_token_events(chunk)
        self._record.token_events += events
        if self._previous_s is None:
            self._record.first_token(now_s)
            if events > 1:
                self._mode.itl.observe_events(0.0, events - 1)
        elif events:
            self._mode.itl.observe_events(now_s - self._previous_s, events)
        else:
            return
        self._previous_s = now_s

    async def _hand_over(self) -> bool:
        """The stream to the relay thread until it gives it back, where nothing but the usual
        per-chunk work is due (as for ``push``); True once it did, its chunks accounted for here."""
        leg, client, previous_s = self._leg, self._client, self._previous_s
        if (previous_s is None or leg is None or client is None or self._native is None or not self._is_steady
                or (client_fd := client.idle_fd) is None):
            return False
        ticket = Ticket(previous_s=previous_s, deadline_s=self._deadline_s,
                        idle_timeout_s=self._spec.decode_idle_timeout_s, watch_usage=self._watches_usage)
        try:
            back = await leg.response.relay_natively(self._native, client_fd, ticket)
        except RelayCancelled as exc:  # the client left after the thread had sent what it read
            self._take_relayed(exc.handback)
            raise
        if back is None:  # the thread could not take it: this stream stays in Python
            self._native = None
            return False
        if back.unsent:
            client.write_framed(back.unsent)
        self._take_relayed(back)
        return True

    def _take_relayed(self, back: Handback) -> None:
        """The relay thread's chunks into the request's timing and record, as if sent here."""
        if back.payload:
            self._sent.append(back.payload)
        if back.token_events:
            self._mode.itl.add(back.gap_counts, back.gap_sum_s)
            self._previous_s = back.previous_s
            self._record.token_events += back.token_events

    @property
    def _watches_usage(self) -> bool:
        """The usage event must pass here: behind a lead it is rewritten to one engine's, a handoff is judged
        by it, and, where ``_watches_all_usage``, it is rewritten for the client or settles the request's tokens."""
        return self._watches_all_usage or self._rewrites_usage or self._kv_outcome is KvOutcome.UNKNOWN

    def _take_usage(self, data: bytes, usage: Mapping[str, Any] | None) -> bytes:
        """A whole reply, or the events carrying its ``usage``: the handoff judged and the request's tokens
        settled by it; the client gets it as one engine writes it (pd/lead.py) and, where hidden, no cached tokens."""
        self._judge_kv(usage)
        if usage is not None and self._call.on_usage is not None:
            self._call.on_usage(usage)
        if self._rewrites_usage and self._lead is not None:
            data = usage_as_one_engines(data, lead=self._lead)
        return hide_cached_tokens(data) if self._hides_cached_tokens else data

    def _cut_off(self, client: ClientSocket) -> bytes:
        """The event that ends a stream whose client has more than ``max_stream_buffer_bytes`` waiting: it reads
        slower than the engine writes. The decode leg closes with the stream (``finish``: the engine aborts it)."""
        waiting = client.buffered_bytes
        client.cut_off(grace_s=self._spec.idle_timeout_s)
        log.warning("request_id=%s the client reads too slowly: %d bytes of its reply wait for it, more than "
                    "gateway.max_stream_buffer_bytes (%d); stream ended", self._call.request_id, waiting,
                    self._spec.max_stream_buffer_bytes)
        return self._record.error_event(
            f"the client read the stream too slowly: more than {self._spec.max_stream_buffer_bytes} bytes of it "
            "waited to be read", "client_too_slow")

    def _judge_kv(self, usage: Mapping[str, Any] | None) -> None:
        """The handoff's outcome from the decode engine's usage, once per request."""
        if self._kv is None or self._kv_outcome is not KvOutcome.UNKNOWN or self._leg is None:
            return
        outcome, reason = kv_proof.judge(usage, prefilled_tokens=self._kv.prompt_tokens)
        self._kv_outcome = outcome
        result = kv_proof.integrity(self._kv.fields, outcome)
        self._metrics.kv_integrity.labels(result.value, self._call.path).inc()
        log.info("request_id=%s kv_integrity=%s prefill=%s decode=%s", self._call.request_id, result.value,
                 self._kv.prefill_url, self._leg.endpoint.url)
        self._kv_judged(self._kv, self._call.request_id, outcome=outcome, reason=reason,
                        decode_url=self._leg.endpoint.url)

    @property
    def _is_steady(self) -> bool:
        """Past the handoff, with no role event left to drop: what ``push`` and ``_hand_over`` need,
        beside a first token out and a client socket, before chunks may skip ``stream``'s work."""
        return not self._drop_role and self._prefill_done_s is None and not self._echoed_left

    def _drop_echoed(self, chunk: bytes) -> bytes:
        """``chunk`` without the decode engine's events of a forced lead's token (pd/lead.py); the
        handoff is over with the first of them."""
        assert self._lead is not None
        dropped = drop_echoed(chunk, self._echoed_left, lead=self._lead, path=self._call.path)
        self._echoed_left = dropped.left
        if dropped.is_other_token:
            log.error("request_id=%s the decode engine's first token was not the prefill engine's: is it started "
                      "with pdserve's logits processor (%s)?", self._call.request_id, "pdserve_vllm/first_token.py")
        if self._prefill_done_s is not None:
            self._handoff_done(time.perf_counter())
        return dropped.chunk

    async def _opened(self) -> bytes | None:
        """Wait for the decode leg opening behind the lead; None once it is open, else the error
        event that ends the stream (every decode engine tried failed, or none was left)."""
        assert self._opening is not None
        try:  # cancelled (the client left), the task stays for finish(): its leg may have opened meanwhile
            self._leg = await self._opening
        except PdserveError as exc:
            self._opening = None
            log.error("request_id=%s no decode engine took the request after its first token: %s",
                      self._call.request_id, exc)
            return self._record.error_event("no decode engine took the request", "decode_stream_failed")
        self._opening = None
        return None

    async def _resume(self, failure: LegFailed, *, is_silent: bool) -> bytes | Step:
        """Move the stream to another decode engine (MOVED), else the bytes that end it. An engine that is
        only silent (``is_silent``) keeps a stream no other engine can take (KEPT) until the request's
        deadline: on a starved machine an engine can pause past decode_idle_timeout_s, and ending the
        stream there helps nobody."""
        assert self._leg is not None
        whole = self._whole_body()
        body, why_not = (whole, None) if whole is not None else self._continuation()
        if body is None and why_not is None:
            self._log_broken(failure)
            return SSE_DONE  # only the end marker was lost
        if body is not None and await self._switch(failure, body, keep=is_silent):
            if whole is not None and self._lead is not None and self._sent:  # the new engine writes a forced lead's token again
                self._echoed_left = self._lead.echoed_events
            return Step.MOVED
        if is_silent:
            if time.perf_counter() > self._deadline_s:
                return self._record.error_event("the request ran past its deadline", "request_timeout")
            log.warning("request_id=%s no other decode engine can take the stream (%s): waiting on it",
                        self._call.request_id, why_not or failure)
            self._leg.response.wait_longer()
            return Step.KEPT
        if why_not is not None:
            self._log_broken(failure)
            log.warning("request_id=%s stream not resumed: %s", self._call.request_id, why_not)
        return self._record.error_event("the decode engine failed" if whole is not None else "the decode engine's stream broke",
                                        "decode_stream_failed")

    def _continuation(self) -> tuple[dict[str, Any] | None, str | None]:
        """The request that generates the rest of the stream elsewhere, or why there is none; (None, None): the
        stream had finished but for its end marker."""
        sent = resume.read_sent(self._sent, path=self._call.path)
        if sent.is_finished:
            return None, None
        why_not = resume.why_not_resumable(self._call.body, path=self._call.path) or (
            None if sent.is_readable else "a reply the gateway cannot read back") or (
            None if self._spec.resume_streams else "gateway.resume_streams is off")
        if why_not is not None:
            return None, why_not
        return resume.continuation_body(self._call.body, sent, path=self._call.path), None

    def _first_timeout_s(self, timeout_s: float) -> float:
        """A stream's wait for the decode engine's first token: while a KV handoff is pending, at most
        ``kv_pull_timeout_s`` (a pull across a cut link hangs rather than fails). A whole reply's
        headers come with its last token: gateway/whole_pull.py tells its hung pull from a long reply."""
        return min(timeout_s, self._spec.kv_pull_timeout_s) if self._prefill_done_s is not None else timeout_s

    async def _pull_lost(self) -> bool:
        """No first token within ``kv_pull_timeout_s`` of a handoff: the pull is taken for lost (counted
        as recomputed, the prefill engine's breaker told) and the request, which nothing of the decode
        engine's reached the client yet, goes again with no handoff, to the same engine too: the link
        failed, not it. False if none took it."""
        assert self._leg is not None and self._kv is not None
        endpoint = self._leg.endpoint
        self._kv_outcome = KvOutcome.RECOMPUTED
        self._kv_judged(self._kv, self._call.request_id, outcome=KvOutcome.RECOMPUTED,
                        reason=RecomputeReason.PULL_TIMEOUT, decode_url=endpoint.url)
        whole = self._whole_body()
        return whole is not None and await self._switch(None, whole, again=endpoint)

    def _whole_body(self) -> dict[str, Any] | None:
        """The request that writes the whole reply on another engine: the client's own while it has seen
        nothing, the lead's continuation while it has only the prefill engine's token; None after that."""
        if not self._sent:
            return self._call.body
        return self._lead.continuation if self._lead is not None and len(self._sent) == 1 else None

    async def _switch(self, failure: LegFailed | None, body: dict[str, Any], *, again: Endpoint | None = None,
                      keep: bool = False) -> bool:
        """Open ``body`` on another decode engine, or on ``again``, and close the leg (``failure``: counted
        against its engine); False if none took it. ``keep``: the leg closes only once another opened, and
        stays untouched if none did."""
        assert self._leg is not None
        if not keep:
            self._leave_leg(failure)
        try:
            leg = await self._reopen(body, again, wait=not keep)  # a silent leg kept meanwhile is not read
        except PdserveError as exc:
            if not keep:
                log.error("request_id=%s no other decode engine took the request: %s", self._call.request_id, exc)
            return False
        if keep:
            self._leave_leg(failure)
        self._leg = leg
        self._prefill_done_s = None  # what follows is not a KV handoff
        if self._kv_outcome is KvOutcome.UNKNOWN:
            self._kv_outcome = None  # nor can its usage judge one
        self._metrics.decode_switches.labels("resumed" if self._sent else "restarted").inc()
        log.warning("request_id=%s moved to decode engine %s after %d chunk(s)",
                    self._call.request_id, self._leg.endpoint.url, len(self._sent))
        return True

    def _leave_leg(self, failure: LegFailed | None) -> None:
        """Close the decode leg; ``failure``: logged and counted against its engine."""
        assert self._leg is not None
        if failure is not None:
            self._log_broken(failure)
            self._leg_failed(self._leg.endpoint, self._call.request_id, failure, is_unreachable=False)
        self._leg.close()

    def _log_broken(self, failure: LegFailed) -> None:
        assert self._leg is not None
        log.error("request_id=%s role=decode endpoint=%s stream broke: %s",
                  self._call.request_id, self._leg.endpoint.url, failure)
        self._leg.trace.failed(failure)

    def _handoff_done(self, now_s: float) -> None:
        """The decode engine's first token: the KV handoff is over."""
        assert self._prefill_done_s is not None and self._leg is not None
        handoff_s = now_s - self._prefill_done_s
        self._prefill_done_s = None
        self._record.handoff_done(handoff_s, decode_url=self._leg.endpoint.url)

    def finish(self) -> None:
        """Close the upstream reply and record the request; idempotent."""
        if self._is_finished:
            return
        self._is_finished = True
        elapsed_s = time.perf_counter() - self._call.arrived_s
        self._mode.e2e.observe(elapsed_s)
        if self._opening is not None:  # the stream ended before its decode leg was awaited
            self._opening.cancel()  # the opener gives the handoff back if no decode engine saw it
            self._opening.add_done_callback(close_opened)
        if self._leg is not None:
            self._leg.close()
        self._log_line(elapsed_s)
        self._record.add_to_recent(elapsed_s, sent=self._sent, decode_url=self._decode_url, kv_outcome=self._kv_outcome)

    def _log_line(self, elapsed_s: float) -> None:
        """The request's one log line, written once its reply is done. A line per leg delayed the
        first token: the writer thread held the interpreter with the prefill leg's line just as
        the decode engine answered (docs/benchmarks.md, section 1)."""
        record = self._record
        ttft = "" if record.ttft_s is None else f" ttft_ms={record.ttft_s * 1000:.1f}"
        kv, prefill = self._kv, ""
        if kv is not None:
            prefill = (f" prefill_endpoint={kv.prefill_url} prefill_ms={record.prefill_ms:.1f} "
                       f"prompt_tokens={kv.prompt_tokens} kv_blocks={kv.block_count}")
        log.info("request_id=%s mode=%s endpoint=%s status=200 elapsed_ms=%.1f%s%s", self._call.request_id,
                 record.mode_name, self._decode_url, elapsed_s * 1000, ttft, prefill)

    @property
    def _decode_url(self) -> str | None:
        return None if self._leg is None else self._leg.endpoint.url
