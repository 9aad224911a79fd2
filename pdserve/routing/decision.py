"""Per request: disaggregate (prefill engine, then decode engine) or prefill on the decode engine. Pure.

Disaggregating costs a second leg and a KV handoff; it pays for a long uncached prompt, whose
prefill would stall the decode engine's running streams. A short uncached part (a short prompt,
or one mostly cached on the decode engine) is cheaper computed where it will be decoded, and so
is any prompt while every prefill engine is saturated and the decode engine has room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from pdserve.gateway_config import RoutingSpec
from pdserve.routing.cost import EngineView


class Mode(StrEnum):
    """How one request is served; the values are those of the X-PD-Mode header."""

    PD = "pd"  # prefill engine, then decode engine
    LOCAL = "local"  # the decode engine does both phases


class Reason(StrEnum):
    """Why a request was served in its mode: the ``reason`` label of the decisions counter."""

    REQUESTED = "requested"  # the client's X-PD-Mode header
    CONFIGURED = "configured"  # routing.disaggregation is always or never
    SHORT_UNCACHED = "short_uncached"  # little of the prompt is missing from the decode engine's cache
    NO_PREFILL_ENGINE = "no_prefill_engine"  # none is healthy
    PREFILL_SATURATED = "prefill_saturated"  # every prefill engine is saturated, the decode engine has room
    LONG_UNCACHED = "long_uncached"  # disaggregating pays


@dataclass(frozen=True, slots=True)
class Decision:
    mode: Mode
    reason: Reason
    uncached_tokens: float  # estimated prompt tokens the decode engine does not hold


def decide(*, prompt_tokens: float, decode: EngineView, prefill: Sequence[EngineView], spec: RoutingSpec,
           requested: Mode | None = None) -> Decision:
    """The mode for one request whose decode engine is already chosen (``decode``).

    ``prefill``: the healthy prefill engines; ``requested``: the client's X-PD-Mode, if sent.
    """
    uncached = decode.uncached_tokens(prompt_tokens)
    if requested is not None:
        return Decision(requested, Reason.REQUESTED, uncached)
    if spec.disaggregation != "auto":
        return Decision(Mode.PD if spec.disaggregation == "always" else Mode.LOCAL, Reason.CONFIGURED, uncached)
    if uncached <= spec.local_max_uncached_tokens:
        return Decision(Mode.LOCAL, Reason.SHORT_UNCACHED, uncached)
    if not prefill:
        return Decision(Mode.LOCAL, Reason.NO_PREFILL_ENGINE, uncached)
    if all(is_saturated(view, spec=spec) for view in prefill) and has_room(decode, spec=spec):
        return Decision(Mode.LOCAL, Reason.PREFILL_SATURATED, uncached)
    return Decision(Mode.PD, Reason.LONG_UNCACHED, uncached)


def is_saturated(prefill: EngineView, *, spec: RoutingSpec) -> bool:
    """A prefill engine with a long queue: this gateway's tokens on it, or its own waiting requests
    (which also counts the other gateway processes')."""
    return (prefill.queued_prefill_tokens >= spec.prefill_saturated_tokens
            or prefill.waiting >= spec.prefill_saturated_waiting)


def has_room(decode: EngineView, *, spec: RoutingSpec) -> bool:
    """A decode engine that can take a prefill without queueing requests or crowding its KV cache."""
    return decode.waiting == 0 and decode.kv_usage < spec.decode_room_kv_usage
