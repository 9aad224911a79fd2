"""The gateway's Prometheus metrics, in a registry owned by one app (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics import Histogram as HistogramChild

from pdserve.role import Role

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
MODES = ("pd", "local")


@dataclass(frozen=True, slots=True)
class ModeMetrics:
    """Histograms already bound to one mode's label, so the per-token path does no lookups."""

    ttft: HistogramChild
    itl: HistogramChild
    e2e: HistogramChild


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_requests", "Requests answered, by route, mode and HTTP status.",
            ["route", "mode", "status"], registry=self.registry,
        )
        ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "From request arrival to the first streamed token.",
            ["mode"], buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        itl = Histogram(
            "pdserve_inter_token_latency_seconds", "Gap between consecutive streamed chunks.",
            ["mode"], buckets=_TOKEN_GAP_BUCKETS_S, registry=self.registry,
        )
        e2e = Histogram(
            "pdserve_e2e_request_latency_seconds", "From request arrival to the last byte sent.",
            ["mode"], buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.modes = {mode: ModeMetrics(ttft.labels(mode), itl.labels(mode), e2e.labels(mode)) for mode in MODES}
        leg = Histogram(
            "pdserve_leg_duration_seconds",
            "Per phase: prefill = request to KV ready; decode = request to first token.",
            ["role"], buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.legs = {role: leg.labels(role.value) for role in Role}
        self.kv_handoff = Histogram(
            "pdserve_kv_handoff_seconds",
            "From prefill completion to the first token of the decode engine (KV pull + 1 step).",
            buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.leg_failures = Counter(
            "pdserve_leg_failures", "Legs that failed and were retried or reported, by role.",
            ["role"], registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
