"""What one relayed request leaves behind, filled once per request and never per chunk: its TTFT and KV
handoff in the metrics, how its stream ended, and its row in the live page's list (gateway/recent.py)."""

from __future__ import annotations

import time

from pdserve.gateway.call import Call
from pdserve.gateway.handoffs import Handoffs
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.recent import FinishedRequest, RecentRequests, status_of
from pdserve.pd.kv import KVTransferParams
from pdserve.pd.kv_proof import KvOutcome
from pdserve.protocol import sse_error_event
from pdserve.role import Role
from pdserve.routing.decision import Mode


class RelayRecord:
    """One request's timings and ending, as the relay (gateway/relay.py) meets them."""

    def __init__(self, call: Call, *, mode: Mode, kv: KVTransferParams | None, prefill_done_s: float | None,
                 metrics: GatewayMetrics, handoffs: Handoffs, recent: RecentRequests) -> None:
        self._call, self._metrics, self._handoffs, self._recent = call, metrics, handoffs, recent
        self.mode_name = mode.value
        self.kv, self.prefill_ms = kv, None if prefill_done_s is None else (prefill_done_s - call.arrived_s) * 1000
        self.ttft_s: float | None = None
        self.handoff_s: float | None = None
        self.error_code: str | None = None
        self.token_events = 0  # the stream's token events sent (gateway/token_gaps.py), whatever came at once

    def first_token(self, now_s: float) -> None:
        self._call.trace.first_token()
        self.ttft_s = now_s - self._call.arrived_s
        self._metrics.modes[self.mode_name].ttft.observe(self.ttft_s)

    def handoff_done(self, handoff_s: float, *, decode_url: str) -> None:
        """The decode engine's first token: the KV handoff is over."""
        self.handoff_s = handoff_s
        self._metrics.kv_handoff.observe(handoff_s)
        self._metrics.legs[Role.DECODE].observe(handoff_s)
        # Slow or not is judged later against the engine's own transfer times (kv_monitor.py):
        # a handoff also waits in a busy decode engine's queue, which is load, not the transport.
        self._metrics.kv_handoff_queue.observe(self._handoffs.record(decode_url, handoff_s))

    def error_event(self, what: str, code: str) -> bytes:
        self.error_code = code  # every error ending goes through here
        return sse_error_event(f"{what} (request id {self._call.request_id})", code=code)

    def add_to_recent(self, elapsed_s: float, *, sent: list[bytes], decode_url: str | None,
                      kv_outcome: KvOutcome | None) -> None:
        is_stream = self._call.is_stream
        status = status_of(is_stream=is_stream, error_code=self.error_code, has_first_token=self.ttft_s is not None,
                           has_end_marker=bool(sent) and b"[DONE]" in b"".join(sent[-2:]))
        self._recent.add(FinishedRequest(
            request_id=self._call.request_id, mode=self.mode_name,
            prefill_url=None if self.kv is None else self.kv.prefill_url,
            decode_url=decode_url, ttft_s=self.ttft_s, handoff_s=self.handoff_s, e2e_s=elapsed_s,
            chunks=self.token_events, status=status,
            kv=None if kv_outcome is None else kv_outcome.value, finished_unix_s=time.time()))
