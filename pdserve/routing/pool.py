"""The engines the gateway can send legs to, with their health and in-flight counts."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from pdserve.role import Role


@dataclass(slots=True)
class Endpoint:
    """One engine's OpenAI server. Mutable: the health loop and the orchestrator update it."""

    role: Role
    url: str
    is_healthy: bool = True
    in_flight: int = 0
    failed_probes: int = 0  # in a row


class Pool:
    """Prefill and decode endpoints. Starts optimistic: the health loop probes at once."""

    def __init__(self, *, prefill_urls: Sequence[str], decode_urls: Sequence[str]) -> None:
        self._endpoints = {
            Role.PREFILL: [Endpoint(Role.PREFILL, url.rstrip("/")) for url in prefill_urls],
            Role.DECODE: [Endpoint(Role.DECODE, url.rstrip("/")) for url in decode_urls],
        }

    def all(self, role: Role) -> list[Endpoint]:
        return self._endpoints[role]

    def healthy(self, role: Role) -> list[Endpoint]:
        return [endpoint for endpoint in self._endpoints[role] if endpoint.is_healthy]

    @contextmanager
    def in_flight(self, endpoint: Endpoint) -> Iterator[Endpoint]:
        endpoint.in_flight += 1
        try:
            yield endpoint
        finally:
            endpoint.in_flight -= 1
