"""The KV handoffs the gateway timed, per decode engine, between two reads of its /metrics.

Pure bookkeeping, no I/O and no logging: the orchestrator records, kv_monitor.py judges each
window against the engine's own transfer times.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class HandoffTally:
    """Handoffs to one decode engine (prefill done -> first decoded token), as the gateway timed them."""

    count: int = 0
    slow: int = 0  # over gateway.slow_handoff_warn_s
    slowest_s: float = 0.0

    def plus(self, other: HandoffTally) -> HandoffTally:
        return HandoffTally(count=self.count + other.count, slow=self.slow + other.slow,
                            slowest_s=max(self.slowest_s, other.slowest_s))


class Handoffs:
    """Per decode engine URL: the tally since the last read, and the engine's mean KV transfer
    time in the last read window that had transfers."""

    def __init__(self, *, slow_s: float) -> None:
        self._slow_s = slow_s
        self._tallies: dict[str, HandoffTally] = {}
        self._transfer_s: dict[str, float] = {}

    def record(self, url: str, handoff_s: float) -> float:
        """Count one handoff of ``handoff_s`` seconds to ``url``; returns the part of it not spent
        moving KV (its queueing part), in seconds: the handoff less the engine's recent mean
        transfer time, never below 0."""
        tally = self._tallies.get(url, HandoffTally())
        self._tallies[url] = replace(tally, count=tally.count + 1, slow=tally.slow + (handoff_s > self._slow_s),
                                     slowest_s=max(tally.slowest_s, handoff_s))
        return max(0.0, handoff_s - self._transfer_s.get(url, 0.0))

    def take(self, url: str, *, transfer_s: float | None) -> HandoffTally:
        """The tally since the last take, which starts a new one; ``transfer_s`` is the engine's
        mean transfer time in the window just read, None when it made no transfers."""
        if transfer_s is not None:
            self._transfer_s[url] = transfer_s
        return self._tallies.pop(url, HandoffTally())
