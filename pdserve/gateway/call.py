"""One client request as the orchestrator sees it, and the reply it hands back to the server."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.gateway.tracing import NO_TRACE, RequestTrace
from pdserve.gateway_config import GatewaySpec
from pdserve.routing.decision import Mode
from pdserve.routing.prefix import PromptKey


@dataclass(frozen=True, slots=True)
class Call:
    """What the orchestrator needs to know about one client request."""

    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]
    request_id: str
    mode: Mode | None  # what the client asked for (X-PD-Mode); None: the router decides
    arrived_s: float  # time.perf_counter() at arrival
    may_prefill_locally: bool = True  # False: the prefill leg must work (a warm-up proves both legs)
    trace: RequestTrace = NO_TRACE  # its spans, or the client's traceparent passed through (gateway/tracing.py)
    prompt_key: PromptKey | None = None  # the router's key of its prompt, where already made (else the router makes it)
    # Told the engine's usage of the request, once its reply carries one (gateway/key_limits.py's Charge); None: no one.
    on_usage: Callable[[Mapping[str, Any]], None] | None = None

    @property
    def is_stream(self) -> bool:
        return bool(self.body.get("stream"))

    def time_left_s(self, spec: GatewaySpec) -> float:
        """Until the request's own deadline (``request_timeout_s``), never below zero."""
        return max(self.arrived_s + spec.request_timeout_s - time.perf_counter(), 0.0)


class ClientSocket(Protocol):
    """The client's connection, where the server offers it (gateway/client_reply.py's ClientTransport)."""

    def write_now(self, chunk: bytes) -> bool:
        """Write one chunk of the stream at once, if nothing waits ahead of it in the client's buffer;
        otherwise write nothing and return False (the chunk then goes the awaited way)."""

    def write_framed(self, data: bytes) -> None:
        """Queue bytes already framed as the chunked body (what the relay thread could not send)."""

    @property
    def idle_fd(self) -> int | None:
        """The socket's descriptor while nothing waits in its buffer (the relay thread may write to it), else None."""

    @property
    def buffered_bytes(self) -> int:
        """Reply bytes written and not yet taken by the client's socket."""

    def cut_off(self, *, grace_s: float) -> None:
        """The stream ends early: once its reply is written, the connection closes, and is dropped should the client
        not take what waits for it within ``grace_s``."""


@dataclass(frozen=True, slots=True)
class Reply:
    """Either a whole JSON body or a stream of SSE bytes (exactly one is set).

    ``stream(client)`` yields the chunks the server is to send; given the ``client`` socket, it
    writes there the chunks that can be written at once instead, as they arrive, and yields only the others.
    ``close`` must be called once the stream is done or abandoned: a stream that was never
    iterated (client gone before the first byte) cannot clean up after itself.
    ``first_chunk_ready``: the stream's first chunk is in hand (the prefill engine's token), so the
    response head may wait for it and leave in the same packet.
    ``mode``: how the request is served (PD or local), whatever the client asked; the metrics' label.
    """

    json_body: bytes | None = None
    stream: Callable[[ClientSocket | None], AsyncIterator[bytes]] | None = None
    close: Callable[[], None] = lambda: None
    first_chunk_ready: bool = False
    mode: Mode | None = None
