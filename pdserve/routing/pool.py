"""The engines the gateway can send legs to, with their health and in-flight counts.

Which engines exist is told by an endpoint source (routing/sources.py); the pool only keeps them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engines.kv_path import KvPath
from pdserve.role import Role
from pdserve.routing.load import EngineLoad


@dataclass(slots=True)
class Endpoint:
    """One engine's OpenAI server. Mutable: the health loop and the orchestrator update it."""

    role: Role
    url: str
    is_healthy: bool = True
    in_flight: int = 0
    failed_probes: int = 0  # in a row
    # Circuit breaker (routing/breaker.py): failed legs in a row, and out of rotation until then.
    failed_legs: int = 0
    ejections_in_row: int = 0
    ejected_until_s: float = 0.0  # time.monotonic()
    failed_pulls: int = 0  # a prefill engine's handoffs in a row its decode engines computed again (pd/kv_proof.py)
    kv_recomputed: int = 0  # such handoffs in all, for `pdserve status`
    # The KV path the engine logged (backends, transports, provider, buffer): /health, /metrics, verify.
    kv_path: KvPath = field(default_factory=KvPath)
    load: EngineLoad = field(default_factory=EngineLoad)  # its own /metrics, as last read: set it with take_load
    routed: int = 0  # legs this gateway process has sent it
    legs_ended: int = 0  # legs of this gateway process that have ended on it
    legs_ended_elsewhere: int = 0  # ... of the other gateway workers on this host (shared memory, gateway/workers.py)
    legs_ended_at_read: int = 0  # all_legs_ended when ``load`` was read
    queued_prefill_tokens: float = 0.0  # uncached prompt tokens of this process's prefill legs open on it

    @property
    def all_legs_ended(self) -> int:
        """Legs every gateway process on this host has ended on the engine, as far as this one knows."""
        return self.legs_ended + self.legs_ended_elsewhere

    def take_load(self, load: EngineLoad, *, legs_ended_at_read: int | None = None) -> None:
        """A new read of the engine's load; legs that end after it are not in it (``legs_ended_since_read``).
        ``legs_ended_at_read``: ``all_legs_ended`` when the read was taken, if another process took it."""
        self.load = load
        self.legs_ended_at_read = self.all_legs_ended if legs_ended_at_read is None else legs_ended_at_read

    @property
    def legs_ended_since_read(self) -> int:
        """Legs that ended on the engine after its load was read: that read still counts them."""
        return max(0, self.all_legs_ended - self.legs_ended_at_read)


class Pool:
    """Prefill and decode endpoints. Starts optimistic: the health loop probes at once."""

    def __init__(self, *, prefill_urls: Sequence[str] = (), decode_urls: Sequence[str] = ()) -> None:
        self._endpoints: dict[Role, list[Endpoint]] = {role: [] for role in Role}
        self.set_urls(Role.PREFILL, prefill_urls)
        self.set_urls(Role.DECODE, decode_urls)

    def set_urls(self, role: Role, urls: Sequence[str]) -> bool:
        """Make ``urls`` the endpoints of ``role``; known ones keep their health and in-flight
        counts, so requests already running on them are unaffected. True if anything changed."""
        wanted = list(dict.fromkeys(url.rstrip("/") for url in urls))
        known = {endpoint.url: endpoint for endpoint in self._endpoints[role]}
        if wanted == list(known):
            return False
        self._endpoints[role] = [known.get(url) or Endpoint(role, url) for url in wanted]
        return True

    def all(self, role: Role) -> list[Endpoint]:
        return self._endpoints[role]

    def healthy(self, role: Role) -> list[Endpoint]:
        """Endpoints that answer their health probe and are not ejected by the circuit breaker."""
        now_s = time.monotonic()
        return [endpoint for endpoint in self._endpoints[role]
                if endpoint.is_healthy and endpoint.ejected_until_s <= now_s]

    @property
    def can_serve(self) -> bool:
        """Each role has a healthy endpoint: a request can go through both legs."""
        return all(self.healthy(role) for role in Role)

    @contextmanager
    def in_flight(self, endpoint: Endpoint) -> Iterator[Endpoint]:
        """Count one leg on ``endpoint`` for the block (and one more leg sent it, for good)."""
        endpoint.in_flight += 1
        endpoint.routed += 1
        try:
            yield endpoint
        finally:
            endpoint.in_flight -= 1
            endpoint.legs_ended += 1


class Engines(Protocol):
    """What the orchestrator reads of the pool: a role's engines, and those it may send legs to now."""

    def all(self, role: Role) -> list[Endpoint]: ...

    def healthy(self, role: Role) -> list[Endpoint]: ...


class PairOnly:
    """The pool narrowed to one (prefill, decode) pair, the same endpoints (health, breaker, in-flight counts):
    what the orchestrator routes among for a request meant for that pair alone (the gateway's warm-up of each
    pair's chats, gateway/readiness.py)."""

    def __init__(self, pool: Pool, *, prefill_url: str, decode_url: str) -> None:
        self._pool, self._urls = pool, {Role.PREFILL: prefill_url, Role.DECODE: decode_url}

    def all(self, role: Role) -> list[Endpoint]:
        return [endpoint for endpoint in self._pool.all(role) if endpoint.url == self._urls[role]]

    def healthy(self, role: Role) -> list[Endpoint]:
        return [endpoint for endpoint in self._pool.healthy(role) if endpoint.url == self._urls[role]]
