"""The handoff and prefill-leg times bench compare reads from the gateway's own /metrics."""

from __future__ import annotations

import pytest

from pdserve.bench.leg_times import Histogram, parse_leg_times
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.pd.transfer_stats import TransferCounters
from pdserve.role import Role


def rendered(handoffs_s: list[float], prefills_s: list[float]) -> str:
    metrics = GatewayMetrics()
    for seconds in handoffs_s:
        metrics.kv_handoff.observe(seconds)
        metrics.legs[Role.DECODE].observe(seconds)  # same histogram family, other label: must not count
    for seconds in prefills_s:
        metrics.legs[Role.PREFILL].observe(seconds)
    return metrics.render().decode()


def test_reads_the_gateways_histograms_and_subtracts_a_window() -> None:
    before = parse_leg_times(rendered([0.02], [0.1]))
    after = parse_leg_times(rendered([0.02, 0.03, 0.04, 0.2], [0.1, 0.1, 0.1, 0.1]))

    window = after.since(before)

    assert window.handoff.count == 3 and window.handoff.sum_s == pytest.approx(0.27)
    assert window.prefill.count == 3
    assert window.handoff.mean_s == pytest.approx(0.09)


def test_quantiles_interpolate_within_buckets_like_prometheus() -> None:
    histogram = Histogram(buckets=((0.01, 0.0), (0.05, 10.0), (0.1, 20.0), (float("inf"), 20.0)), sum_s=1.0, count=20)

    assert histogram.quantile_s(0.25) == pytest.approx(0.03)  # rank 5 of the 10 between 10 and 50 ms
    assert histogram.quantile_s(0.75) == pytest.approx(0.075)
    assert Histogram().quantile_s(0.5) is None
    beyond = Histogram(buckets=((0.1, 0.0), (float("inf"), 4.0)), sum_s=8.0, count=4)
    assert beyond.quantile_s(0.5) == 0.1  # past the last finite bound: that bound, not infinity


def test_describe_gives_the_bandwidth_a_request_saw() -> None:
    legs = parse_leg_times(rendered([0.04] * 10, [0.1] * 10))
    kv = TransferCounters(bytes=10 * 453e6, seconds=0.1, transfers=10)

    line = legs.describe(kv)

    assert "10 requests" in line and "mean 40.0 ms" in line and "453 MB each = 11.3 GB/s" in line
    assert "no disaggregated request" in parse_leg_times("").describe(kv)
