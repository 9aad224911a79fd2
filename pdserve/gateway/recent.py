"""The last requests this gateway process finished, newest last, for the live page (gateway/dashboard.py).

Bounded, appended once per request when its relay finishes (never per chunk); no I/O, no locks:
only the event-loop thread writes it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pdserve.gateway.call import Call
from pdserve.pd.kv import KVTransferParams
from pdserve.pd.kv_proof import KvOutcome

RECENT_REQUESTS = 50


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One request as its relay saw it end. Times in seconds; None where the request never got there."""

    request_id: str
    mode: str  # "pd" or "local", as served
    prefill_url: str | None  # None: the decode engine prefilled the prompt itself
    decode_url: str | None  # the engine that sent the last byte (another one than first chosen after a failover);
    # None: the stream ended after the prefill engine's token, before a decode engine answered
    ttft_s: float | None  # arrival to first token (a whole reply: to the whole body)
    handoff_s: float | None  # prefill done to first decoded token; None when no KV was handed off
    e2e_s: float  # arrival to the relay's end
    chunks: int  # token events relayed (gateway/token_gaps.py), however the socket grouped them; 0 for a whole reply
    kv: str | None  # pd/kv_proof.py's KvOutcome value: did the prompt cross as KV; None: no handoff
    status: str  # "ok", the error event's code, or "cut" (ended before its end marker: client gone, engine lost)
    finished_unix_s: float  # time.time() at the end


def status_of(*, is_stream: bool, error_code: str | None, has_first_token: bool, has_end_marker: bool) -> str:
    """How a request ended, in one word for the page. Pure."""
    if error_code is not None:
        return error_code
    if not is_stream:
        return "ok" if has_first_token else "failed"
    return "ok" if has_end_marker else "cut"


def never_answered(call: Call, kv: KVTransferParams | None, *, elapsed_s: float) -> FinishedRequest:
    """The record of a request no decode engine answered (every one tried failed, or none was left): it has no
    relay to record it, and a failure the page leaves out is a failure misreported. Pure."""
    return FinishedRequest(
        request_id=call.request_id, mode="pd" if kv is not None else "local",
        prefill_url=None if kv is None else kv.prefill_url, decode_url=None, ttft_s=None, handoff_s=None,
        e2e_s=elapsed_s, chunks=0, kv=None if kv is None else KvOutcome.UNKNOWN.value, status="failed",
        finished_unix_s=time.time())


class RecentRequests:
    """The last ``size`` finished requests."""

    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self._requests: deque[FinishedRequest] = deque(maxlen=size)

    def add(self, request: FinishedRequest) -> None:
        self._requests.append(request)

    def latest(self) -> list[FinishedRequest]:
        """Newest first."""
        return list(reversed(self._requests))
