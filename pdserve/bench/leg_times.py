"""Where a disaggregated request's TTFT goes, read from the gateway's own histograms: the prefill leg,
then the KV handoff (prefill done -> first decoded token: the pull plus one decode step).

The engines' NIXL counters say how fast bytes moved while a transfer ran; only the gateway sees how
long each request waited for its KV, queueing and scheduling included. Parsing and arithmetic only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pdserve.pd.transfer_stats import TransferCounters

_PREFILL = ("pdserve_leg_duration_seconds", (("role", "prefill"),))
_HANDOFF = ("pdserve_kv_handoff_seconds", ())


@dataclass(frozen=True, slots=True)
class Histogram:
    """A Prometheus histogram as read: cumulative counts per upper bound (s), ascending, +Inf last."""

    buckets: tuple[tuple[float, float], ...] = ()
    sum_s: float = 0.0
    count: float = 0.0

    def since(self, earlier: Histogram) -> Histogram:
        before = dict(earlier.buckets)
        return Histogram(tuple((bound, n - before.get(bound, 0.0)) for bound, n in self.buckets),
                         self.sum_s - earlier.sum_s, self.count - earlier.count)

    @property
    def mean_s(self) -> float | None:
        return self.sum_s / self.count if self.count > 0 else None

    def quantile_s(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket holding rank q * count."""
        if self.count <= 0:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower  # beyond the last finite bound: the best the buckets can say
                share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
                return lower + (bound - lower) * share
            lower, below = bound, cumulative
        return lower


@dataclass(frozen=True, slots=True)
class LegTimes:
    prefill: Histogram
    handoff: Histogram

    def since(self, earlier: LegTimes) -> LegTimes:
        return LegTimes(self.prefill.since(earlier.prefill), self.handoff.since(earlier.handoff))

    def describe(self, kv: TransferCounters) -> str:
        """One line: handoff and prefill-leg times, and the handoff bandwidth a request saw on average.

        The bandwidth uses the mean (exact: sum / count); percentiles are interpolated within the
        gateway's histogram buckets, so they are good to a bucket's width.
        """
        handoff, prefill = self.handoff, self.prefill
        mean_s = handoff.mean_s
        if mean_s is None:
            return "KV handoff as requests saw it: no disaggregated request measured"
        mb_each = kv.bytes / kv.transfers / 1e6 if kv.transfers > 0 else 0.0
        bandwidth = f", {mb_each:.3g} MB each = {mb_each / 1e3 / mean_s:.3g} GB/s" if mb_each and mean_s else ""
        return (f"KV handoff as requests saw it (gateway: prefill done -> first decoded token, {handoff.count:.0f} "
                f"requests): mean {_ms(mean_s)} ms{bandwidth}; p50 {_ms(handoff.quantile_s(0.5))} / p90 "
                f"{_ms(handoff.quantile_s(0.9))} / p99 {_ms(handoff.quantile_s(0.99))} ms; prefill leg mean "
                f"{_ms(prefill.mean_s)} ms, p90 {_ms(prefill.quantile_s(0.9))} ms (percentiles from histogram buckets)")


def parse_leg_times(metrics_text: str) -> LegTimes:
    """The gateway's prefill-leg and handoff histograms from its /metrics text. Pure."""
    found: dict[tuple[str, tuple[tuple[str, str], ...]], Histogram] = {}
    for family in text_string_to_metric_families(metrics_text):
        for name, labels in (_PREFILL, _HANDOFF):
            if family.name == name:
                found[(name, labels)] = _histogram(family.samples, name=name, labels=dict(labels))
    return LegTimes(found.get(_PREFILL, Histogram()), found.get(_HANDOFF, Histogram()))


async def fetch_leg_times(session: aiohttp.ClientSession, gateway_url: str, *, timeout_s: float) -> LegTimes:
    """GET the gateway's /metrics and parse it; raises aiohttp.ClientError or TimeoutError."""
    async with session.get(f"{gateway_url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
        reply.raise_for_status()
        return parse_leg_times(await reply.text())


def _histogram(samples: Sequence[Sample], *, name: str, labels: dict[str, str]) -> Histogram:
    buckets: list[tuple[float, float]] = []
    sum_s = count = 0.0
    for sample in samples:
        if any(sample.labels.get(key) != wanted for key, wanted in labels.items()):
            continue
        if sample.name == f"{name}_bucket":
            buckets.append((float(sample.labels["le"]), sample.value))
        elif sample.name == f"{name}_sum":
            sum_s = sample.value
        elif sample.name == f"{name}_count":
            count = sample.value
    return Histogram(tuple(sorted(buckets)), sum_s, count)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"
