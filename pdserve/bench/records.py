"""What the load generator records about one request: timestamps only, derived figures as properties.

Shared by runner.py (writes them) and stats.py (reads them); no I/O here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the client saw it. Times are time.perf_counter() seconds."""

    target: str
    url: str
    sent_s: float
    token_times_s: tuple[float, ...]  # arrival of each SSE event that carried a token
    done_s: float
    output_tokens: int  # the engine's usage count, else the number of token events
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.sent_s if self.token_times_s else None

    @property
    def itl_s(self) -> list[float]:
        """Every gap between consecutive token events (zero when the network coalesced two)."""
        times = self.token_times_s
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as vLLM's benchmarks define it."""
        if not self.token_times_s or self.output_tokens < 2:
            return None
        return (self.done_s - self.token_times_s[0]) / (self.output_tokens - 1)

    @property
    def tokens_per_event(self) -> float:
        """Output tokens each token event stands for (1.0 when the engine streams one per event)."""
        return self.output_tokens / len(self.token_times_s) if self.token_times_s else 0.0
