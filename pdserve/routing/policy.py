"""How the gateway picks one endpoint among the healthy ones of a role."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

from pdserve.role import Role
from pdserve.routing.pool import Endpoint


class Policy(Protocol):
    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint: ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        return candidates[next(self._counter) % len(candidates)]


class LeastInFlight:
    """Fewest requests in flight; ties rotate so equal engines share load evenly.

    Each role rotates on its own: one shared counter, advanced once for the prefill and once
    for the decode choice of every request, would always hand the decode leg the same one of two.
    """

    def __init__(self) -> None:
        self._counters: dict[Role, itertools.count[int]] = {role: itertools.count() for role in Role}

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        fewest = min(endpoint.in_flight for endpoint in candidates)
        tied = [endpoint for endpoint in candidates if endpoint.in_flight == fewest]
        return tied[next(self._counters[tied[0].role]) % len(tied)]
