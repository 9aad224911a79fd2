"""The shape of a choice among the healthy endpoints of a role (routing/router.py's KeyedPolicy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdserve.routing.pool import Endpoint


class Policy(Protocol):
    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint: ...
