"""The gateway's Prometheus metrics, in a registry owned by one app (no module globals)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engines.kv_path import KvPath
from pdserve.gateway.admission import Admission
from pdserve.gateway.token_gaps import GapCounts, GapHistogram
from pdserve.pd.transfer_stats import TransferCounters
from pdserve.role import Role
from pdserve.routing.pool import Pool

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
MODES = ("pd", "local")
ENGINE_LEGS_IN_FLIGHT, ENGINE_LEGS_SENT = "pdserve_engine_legs_in_flight", "pdserve_engine_legs_sent"
ENGINE_KV_SLOW = "pdserve_engine_kv_slow"
WORKERS_COUNTED = "pdserve_gateway_workers_counted"


@dataclass(frozen=True, slots=True)
class ModeMetrics:
    """Histograms already bound to one mode's label, so the per-token path does no lookups."""

    ttft: Histogram
    itl: GapCounts  # observed per token event relayed: lock-free
    e2e: Histogram


class GatewayMetrics:
    def __init__(self, pool: Pool | None = None, admission: Admission | None = None) -> None:
        self.registry = CollectorRegistry()
        if admission is not None:
            self.registry.register(AdmissionCollector(admission))
        self.requests = Counter(
            "pdserve_requests", "Requests answered, by route, mode and HTTP status.",
            ["route", "mode", "status"], registry=self.registry,
        )
        ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "From request arrival to the first streamed token.",
            ["mode"], buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        itl = GapHistogram(
            "pdserve_inter_token_latency_seconds",
            "Gap between consecutive streamed token events; a burst's events after its first count 0.",
            label="mode", values=MODES, buckets_s=_TOKEN_GAP_BUCKETS_S,
        )
        self.registry.register(itl)
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
            "From prefill completion to the first token of the decode engine (queueing + KV pull + 1 step).",
            buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.kv_handoff_queue = Histogram(
            "pdserve_kv_handoff_queue_seconds",
            "The part of a KV handoff not spent moving KV: the handoff less the decode engine's mean "
            "transfer time in its last read window (queueing and steps in a busy engine).",
            buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.leg_failures = Counter(
            "pdserve_leg_failures", "Legs that failed and were retried or reported, by role.",
            ["role"], registry=self.registry,
        )
        self.ejections = Counter(
            "pdserve_engine_ejections", "Engines taken out of rotation by the circuit breaker, by role.",
            ["role"], registry=self.registry,
        )
        self.local_fallbacks = Counter(
            "pdserve_local_fallbacks", "PD requests the decode engine prefilled itself because no "
            "prefill engine could, by reason.", ["reason"], registry=self.registry,
        )
        self.decode_switches = Counter(
            "pdserve_decode_switches", "Requests moved to another decode engine after theirs failed: "
            "restarted (nothing streamed yet) or resumed (mid-stream).", ["kind"], registry=self.registry,
        )
        self.first_tokens = Counter(
            "pdserve_first_tokens", "Requests by route, by where their first token came from (prefill: the "
            "prefill engine's, sent before the decode engine had the KV cache; decode) and why "
            "(pd/first_token.py's Reason).", ["route", "source", "reason"], registry=self.registry,
        )
        self.kv_releases = Counter(
            "pdserve_kv_releases", "KV handoffs no decode leg took, given back to their prefill engine.",
            registry=self.registry,
        )
        self.kv_recomputed = Counter(
            "pdserve_kv_recomputed", "PD requests whose decode engine computed the prompt again rather than "
            "pulling its KV: its usage's cached tokens fell short of the prefilled ones (pd/kv_proof.py), by reason.",
            ["reason"], registry=self.registry,
        )
        self.kv_integrity = Counter(
            "pdserve_kv_integrity", "PD requests by what their decode engine's check of the pulled KV against the "
            "prefill engine's block digests came to (pd/kv_proof.py's IntegrityResult; recomputed: it found them "
            "different, or the pull failed, and computed the prompt before any token), by route.",
            ["result", "route"], registry=self.registry,
        )
        self.disaggregation_decisions = Counter(
            "pdserve_disaggregation_decisions",
            "Requests by how they were served (pd: prefill engine then decode engine; local: the decode "
            "engine alone) and why (routing/decision.py's Reason).",
            ["decision", "reason"], registry=self.registry,
        )

        self.engine_kv = EngineKVCollector(pool)
        self.registry.register(self.engine_kv)
        if pool is not None:
            self.registry.register(EngineLegsCollector(pool))
        # 1 in each process, so a sum over gateway workers (gateway/workers.py) says how many it holds.
        self.registry.register(_One(GaugeMetricFamily(
            WORKERS_COUNTED, "Gateway worker processes whose counts this answer sums (gateway.workers "
            "when every worker answered).", value=1)))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class AdmissionCollector(Collector):
    """Overload state (gateway/admission.py), read when scraped: the request path only counts ints."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        admission = self._admission
        yield GaugeMetricFamily("pdserve_in_flight", "Requests holding a gateway slot (being served).",
                                value=admission.in_flight)
        yield GaugeMetricFamily("pdserve_queue_depth", "Requests waiting for a gateway or engine slot.",
                                value=admission.queued)
        rejected = CounterMetricFamily("pdserve_requests_rejected", "Requests refused with 429, by reason.",
                                       labels=["reason"])
        for reason, count in admission.rejected.items():
            rejected.add_metric([reason.value], count)
        yield rejected


class EngineKVCollector(Collector):
    """The decode engines' own KV-transfer counters, as last scraped, under pdserve's names, labelled with
    the NIXL backend(s) and libfabric provider each engine logged (its endpoint in ``pool``)."""

    def __init__(self, pool: Pool | None = None) -> None:
        self.latest: dict[str, TransferCounters] = {}
        self.is_slow: dict[str, bool] = {}  # the gateway's verdict on the last window judged (gateway/kv_monitor.py)
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        fields = {
            "bytes": ("pdserve_engine_kv_transfer_bytes", "KV cache bytes the decode engine pulled."),
            "seconds": ("pdserve_engine_kv_transfer_seconds", "Time the decode engine spent in KV transfers."),
            "transfers": ("pdserve_engine_kv_transfers", "KV transfers the decode engine completed."),
            "failed": ("pdserve_engine_kv_transfer_failures", "KV transfers the decode engine saw fail."),
        }
        paths = {endpoint.url: endpoint.kv_path for endpoint in self._pool.all(Role.DECODE)} if self._pool else {}
        for field, (name, documentation) in fields.items():
            family = CounterMetricFamily(name, documentation, labels=["endpoint", "backend", "provider"])
            for url, counters in self.latest.items():
                path = paths.get(url, KvPath())
                family.add_metric([url, ",".join(path.backends), path.provider], getattr(counters, field))
            yield family
        slow = GaugeMetricFamily(ENGINE_KV_SLOW, "1 while the gateway judges the decode engine's KV transfers slow or "
                                 "failing (its WARNING; pd/slow_kv.py), else 0.", labels=["endpoint"])
        for url, is_slow in self.is_slow.items():
            slow.add_metric([url], float(is_slow))
        yield slow


class EngineLegsCollector(Collector):
    """Per engine, this process's legs: open now and sent in all. Summed over gateway workers by
    /metrics, which is where ``pdserve status`` takes them from when there are several."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(ENGINE_LEGS_IN_FLIGHT, "Legs open on the engine.", labels=["role", "endpoint"])
        sent = CounterMetricFamily(ENGINE_LEGS_SENT, "Legs sent to the engine.", labels=["role", "endpoint"])
        for role in Role:
            for endpoint in self._pool.all(role):
                in_flight.add_metric([role.value, endpoint.url], endpoint.in_flight)
                sent.add_metric([role.value, endpoint.url], endpoint.routed)
        yield in_flight
        yield sent


class _One(Collector):
    def __init__(self, metric: Metric) -> None:
        self._metric = metric

    def collect(self) -> Iterator[Metric]:
        yield self._metric
