from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.gateway.token_gaps import GapHistogram


def test_gaps_land_in_inclusive_buckets_as_prometheus_counts_them() -> None:
    histogram = GapHistogram("gap_seconds", "Gaps.", label="mode", values=("pd",), buckets_s=(0.01, 0.1))
    for gap_s in (0.01, 0.05, 0.5):
        histogram.labels("pd").observe(gap_s)
    registry = CollectorRegistry()
    registry.register(histogram)
    text = generate_latest(registry).decode()
    assert 'gap_seconds_bucket{le="0.01",mode="pd"} 1.0' in text
    assert 'gap_seconds_bucket{le="0.1",mode="pd"} 2.0' in text
    assert 'gap_seconds_bucket{le="+Inf",mode="pd"} 3.0' in text
    assert 'gap_seconds_count{mode="pd"} 3.0' in text
