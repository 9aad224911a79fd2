"""The gateway's Prometheus metrics, in a registry owned by one app (no module globals)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.pd.transfer_stats import TransferCounters
from pdserve.role import Role

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
MODES = ("pd", "local")


@dataclass(frozen=True, slots=True)
class ModeMetrics:
    """Histograms already bound to one mode's label, so the per-token path does no lookups."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram


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

        self.engine_kv = EngineKVCollector()
        self.registry.register(self.engine_kv)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineKVCollector(Collector):
    """The decode engines' own KV-transfer counters, as last scraped, under pdserve's names."""

    def __init__(self) -> None:
        self.latest: dict[str, TransferCounters] = {}

    def collect(self) -> Iterator[Metric]:
        fields = {
            "bytes": ("pdserve_engine_kv_transfer_bytes", "KV cache bytes the decode engine pulled."),
            "seconds": ("pdserve_engine_kv_transfer_seconds", "Time the decode engine spent in KV transfers."),
            "transfers": ("pdserve_engine_kv_transfers", "KV transfers the decode engine completed."),
            "failed": ("pdserve_engine_kv_transfer_failures", "KV transfers the decode engine saw fail."),
        }
        for field, (name, documentation) in fields.items():
            family = CounterMetricFamily(name, documentation, labels=["endpoint"])
            for url, counters in self.latest.items():
                family.add_metric([url], getattr(counters, field))
            yield family
