from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.gateway.token_gaps import GapCounts, GapHistogram, count_token_events


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


def test_token_events_are_the_sse_events_but_done_and_the_usage_only_one() -> None:
    burst = (b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\n'
             b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\ndata: [DONE]\n\n')
    assert count_token_events(burst) == 2
    assert count_token_events(b"data: [DONE]\n\n") == 0


def test_a_burst_counts_its_gap_once_and_zero_for_each_other_event() -> None:
    gaps = GapCounts((0.01, 0.1))
    gaps.observe_events(0.05, 4)
    assert gaps.counts == [3, 1, 0] and gaps.sum_s == 0.05
