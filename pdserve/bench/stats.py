"""Latency percentiles and goodput from per-request timestamps. Pure; no I/O, no clocks.

Goodput follows DistServe: the rate of requests that meet both SLOs, here TTFT and the
request's own p90 inter-token gap (one slow gap in 256 is jitter; one in ten is not).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.bench.records import RequestRecord

MS_PER_S = 1000.0
_ERROR_CHARS = 160


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    itl_s: float  # bound on each request's p90 inter-token gap


@dataclass(frozen=True, slots=True)
class Window:
    """A span of load generator time (time.perf_counter seconds) that counts."""

    start_s: float
    end_s: float

    def __contains__(self, time_s: float) -> bool:
        return self.start_s <= time_s < self.end_s

    @property
    def length_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True, slots=True)
class Summary:
    """One target at one load level. Latencies in ms; None where nothing was measured."""

    requests: int  # sent inside the windows
    errors: int
    duration_s: float
    request_rate: float  # completed requests/s
    output_tokens_per_s: float
    goodput: float  # requests/s meeting both SLOs
    slo_attainment: float  # share of requests meeting both SLOs
    ttft_ms: Percentiles | None
    itl_ms: Percentiles | None
    tpot_ms: Percentiles | None
    e2e_ms: Percentiles | None
    top_errors: tuple[tuple[str, int], ...] = ()  # the most frequent error messages, with counts


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolated linearly like numpy's default.

    Raises ValueError when ``values`` is empty or ``q`` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], not {q}")
    return _of_sorted(sorted(values), q)


def percentiles_ms(values_s: Sequence[float]) -> Percentiles | None:
    if not values_s:
        return None
    ordered = sorted(values_s)  # once for all three: a run at 2,048 streams gathers millions of gaps
    return Percentiles(*(_of_sorted(ordered, q) * MS_PER_S for q in (50.0, 90.0, 99.0)))


def _of_sorted(ordered: Sequence[float], q: float) -> float:
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """True when ``record`` succeeded, its TTFT is within bound and so is its p90 token gap."""
    if record.error is not None or record.ttft_s is None:
        return False
    gaps = record.itl_s
    return record.ttft_s <= slo.ttft_s and (not gaps or percentile(gaps, 90.0) <= slo.itl_s)


def summarize(records: Iterable[RequestRecord], *, slo: Slo, windows: Sequence[Window]) -> Summary:
    """Summarise the requests sent inside ``windows`` (which do not overlap); token gaps and
    tokens/s count only tokens that arrived inside them, so ramp-up and drain never dilute a
    steady-state figure.
    """
    records = list(records)
    sent = [record for record in records if _inside(record.sent_s, windows)]
    done = [record for record in sent if record.error is None]
    duration_s = sum(window.length_s for window in windows)
    good = [record for record in done if meets_slo(record, slo)]
    spans = [(record, span) for record in records for span in _spans(record.token_times_s, windows)]
    tokens_in_windows = sum(record.tokens_per_event * len(span) for record, span in spans)
    gaps = [record.token_times_s[index] - record.token_times_s[index - 1]
            for record, span in spans for index in span if index > 0]
    return Summary(
        requests=len(sent),
        errors=len(sent) - len(done),
        duration_s=duration_s,
        request_rate=len(done) / duration_s if duration_s > 0 else 0.0,
        output_tokens_per_s=tokens_in_windows / duration_s if duration_s > 0 else 0.0,
        goodput=len(good) / duration_s if duration_s > 0 else 0.0,
        slo_attainment=len(good) / len(sent) if sent else 0.0,
        ttft_ms=percentiles_ms([record.ttft_s for record in done if record.ttft_s is not None]),
        itl_ms=percentiles_ms(gaps),
        tpot_ms=percentiles_ms([record.tpot_s for record in done if record.tpot_s is not None]),
        e2e_ms=percentiles_ms([record.done_s - record.sent_s for record in done]),
        top_errors=tuple(Counter(record.error[:_ERROR_CHARS] for record in sent if record.error).most_common(3)),
    )


def _inside(time_s: float, windows: Sequence[Window]) -> bool:
    return any(time_s in window for window in windows)


def _spans(times_s: Sequence[float], windows: Sequence[Window]) -> list[range]:
    """For times in order, the indices of those inside each window (by bisection: no scan)."""
    return [range(bisect_left(times_s, window.start_s), bisect_left(times_s, window.end_s)) for window in windows]


def whole_run(records: Sequence[RequestRecord]) -> Window:
    """The window from the first request sent to the last one finished (open-loop runs)."""
    if not records:
        return Window(0.0, 0.0)
    return Window(min(record.sent_s for record in records), max(record.done_s for record in records) + 1e-9)
