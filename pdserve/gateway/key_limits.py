"""Per-key limits (access.per_key_max_in_flight, access.per_key_tokens_per_min), counted per tenant (access.py's
AccessKeys.tenant) in this gateway process: its requests in flight, and a token bucket charged with a request's
estimate when it starts and settled with the engine's usage at its end. Past either, RateLimited (429,
Retry-After). O(1) per request, no task; knows nothing of HTTP."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from pdserve.access_config import AccessSpec
from pdserve.errors import RateLimited
from pdserve.gateway.admission import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S

_HOLD_WEIGHT = 0.1  # of the newest request in the running mean of a tenant's request time
_SECONDS_PER_MIN = 60.0


def requested_tokens(body: Mapping[str, Any], *, prompt_tokens: float, max_model_len: int | None) -> int:
    """What a request may spend at most: its prompt (estimated) plus the completion it allows, max_tokens (chat:
    max_completion_tokens first, as vLLM reads them), else the context the prompt leaves, where known. Pure."""
    completion = body.get("max_completion_tokens") or body.get("max_tokens")
    if completion is None:
        completion = max(max_model_len - prompt_tokens, 0) if max_model_len else 0
    return math.ceil(prompt_tokens + completion)


class Charge:
    """One admitted request's tokens on its tenant's bucket; ``settle`` replaces the estimate by what it spent."""

    def __init__(self, tenant: _Tenant, tokens: int) -> None:
        self._tenant, self.tokens = tenant, tokens

    def settle(self, usage: Mapping[str, Any]) -> None:
        """The engine's usage of the request (its last usage event may repeat: each one replaces the charge)."""
        spent = usage.get("total_tokens")
        if isinstance(spent, int) and spent >= 0:
            self._tenant.level += self.tokens - spent  # may go below zero: the next requests wait for it
            self.tokens = spent


class _Tenant:
    """One tenant's requests in flight, its bucket level (tokens, at ``refilled_s``) and mean request time."""

    def __init__(self, level: float, now_s: float) -> None:
        self.in_flight, self.level, self.refilled_s, self.hold_s = 0, level, now_s, 0.0


class KeyLimits:
    """Every tenant's counts in this process; a tenant is kept once seen (there are as many as API keys, plus '')."""

    def __init__(self, spec: AccessSpec, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_in_flight, self._per_min = spec.per_key_max_in_flight, spec.per_key_tokens_per_min
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}

    @property
    def meters_tokens(self) -> bool:
        """Whether tokens are counted (per_key_tokens_per_min): then an admitted request's Charge wants its usage."""
        return self._per_min > 0

    @contextmanager
    def admit(self, tenant: str, *, tokens: int) -> Iterator[Charge]:
        """Count one request of ``tenant`` that may spend ``tokens``, for the block. Raises RateLimited when the
        tenant has ``per_key_max_in_flight`` requests running or queued, or its bucket lacks the tokens (a request
        larger than a whole minute's budget waits for a full bucket)."""
        now_s = self._clock()
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(self._per_min, now_s)
        if self._max_in_flight and state.in_flight >= self._max_in_flight:
            raise RateLimited(f"Rate limit reached for this API key on requests in flight: Limit {self._max_in_flight}.",
                              kind="requests", retry_after_s=_clamped(state.hold_s))
        charge = Charge(state, tokens if self._per_min else 0)
        if self._per_min:
            self._take(state, tokens, now_s=now_s)
        state.in_flight += 1
        try:
            yield charge
        finally:
            state.in_flight -= 1
            held_s = self._clock() - now_s
            state.hold_s = held_s if state.hold_s == 0.0 else state.hold_s + _HOLD_WEIGHT * (held_s - state.hold_s)

    def _take(self, state: _Tenant, tokens: int, *, now_s: float) -> None:
        """Refill ``state``'s bucket to ``now_s``, then take ``tokens`` or raise RateLimited with the refill time."""
        rate_per_s = self._per_min / _SECONDS_PER_MIN
        state.level = min(self._per_min, state.level + (now_s - state.refilled_s) * rate_per_s)
        state.refilled_s = now_s
        needed = min(tokens, self._per_min)
        if state.level < needed:
            wait_s = math.ceil((needed - state.level) / rate_per_s)
            raise RateLimited(f"Rate limit reached for this API key on tokens per min (TPM): Limit {self._per_min}, "
                              f"Requested {tokens}. Please try again in {wait_s}s.",
                              kind="tokens", retry_after_s=max(MIN_RETRY_AFTER_S, wait_s))
        state.level -= tokens


def _clamped(hold_s: float) -> int:
    """A wait for a slot of one's own: by then, on average, one of the tenant's requests has ended."""
    return min(max(MIN_RETRY_AFTER_S, math.ceil(hold_s)), MAX_RETRY_AFTER_S)
