"""The decode leg as the relay holds it: the decode engine's open reply and its engine slot, how that reply
ends when the engine failed the request, and the hooks through which the relay reports a failed leg or
handoff and opens the request on another decode engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.gateway.tracing import LegTrace
from pdserve.pd.engine_reply import EngineReply
from pdserve.pd.kv import KVTransferParams
from pdserve.pd.kv_proof import KvOutcome, RecomputeReason
from pdserve.routing.pool import Endpoint

# How vLLM's server ends a stream whose request failed in the engine (its engine core died, say).
ENGINE_ERROR_EVENT = b'data: {"error"'
# And one the engine aborted: vLLM stopping (Ctrl-C, a restart) with the request in flight ends it so.
ENGINE_ABORT_MARK = b'"finish_reason":"abort"'


def failed_event_at(chunk: bytes) -> int:
    """Where, in ``chunk``, the event starts that ends the engine's stream as failed: its error event, or an
    event it aborted (a client given that would take a cut reply for a finished one); -1: none. Pure."""
    at = chunk.find(ENGINE_ERROR_EVENT)
    if (aborted := chunk.find(ENGINE_ABORT_MARK)) >= 0:
        start = chunk.rfind(b"data: ", 0, aborted)
        at = start if at < 0 else min(at, start)
    return at


class EngineErrorEvent(Exception):
    """The decode engine ended its stream with an error event of its own; ``before``: the events
    ahead of it in the same chunk, which the client still gets."""

    def __init__(self, before: bytes, event: bytes) -> None:
        super().__init__(event[:300].lstrip(b": ").decode(errors="replace"))
        self.before = before


class LegFailedHook(Protocol):
    """Counts, logs and feeds the circuit breaker one failed leg (Orchestrator.leg_failed)."""

    def __call__(self, endpoint: Endpoint, request_id: str, exc: Exception, *, is_unreachable: bool) -> None: ...


class Reopen(Protocol):
    """Opens a body on a decode engine not tried yet, or on ``again`` (Orchestrator.run's reopen); ``wait``: with
    none healthy, for one to recover."""

    def __call__(self, body: dict[str, Any], again: Endpoint | None = None, *,
                 wait: bool = True) -> Awaitable[DecodeLeg]: ...


class KvJudgedHook(Protocol):
    """Counts, logs and feeds the breaker one handoff's outcome (Orchestrator.kv_judged)."""

    def __call__(self, kv: KVTransferParams, request_id: str, *, outcome: KvOutcome,
                 reason: RecomputeReason | None, decode_url: str) -> None: ...


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """A decode engine's open reply and the engine slot it holds (released by ``close``)."""

    endpoint: Endpoint
    response: EngineReply
    stack: ExitStack
    trace: LegTrace

    def close(self) -> None:
        self.response.close()  # an unfinished upstream sees the disconnect and aborts
        self.stack.close()
        self.trace.end()


def close_opened(opening: asyncio.Task[DecodeLeg]) -> None:
    """Close a decode leg that opened after its stream ended (the cancel came too late)."""
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()
