"""Percentiles, per-request figures and goodput on inputs whose answers are known by hand."""

from __future__ import annotations

import pytest

from pdserve.bench.records import RequestRecord
from pdserve.bench.stats import Slo, Window, meets_slo, percentile, summarize, whole_run


def record(*, sent_s: float, token_times_s: tuple[float, ...], error: str | None = None) -> RequestRecord:
    done_s = token_times_s[-1] if token_times_s else sent_s + 1.0
    return RequestRecord(target="t", url="u", sent_s=sent_s, token_times_s=token_times_s, done_s=done_s,
                         output_tokens=len(token_times_s), error=error)


@pytest.mark.parametrize(("q", "expected"), [(0, 1.0), (50, 2.5), (90, 3.7), (99, 3.97), (100, 4.0)])
def test_percentile_interpolates_linearly_like_numpy(q: float, expected: float) -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_percentile_of_one_value_is_that_value() -> None:
    assert percentile([7.0], 99) == 7.0


def test_percentile_refuses_no_values_and_bad_q() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_record_derives_ttft_gaps_and_tpot() -> None:
    r = record(sent_s=10.0, token_times_s=(10.5, 10.6, 10.8, 11.1))
    assert r.ttft_s == pytest.approx(0.5)
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.3])
    assert r.tpot_s == pytest.approx(0.6 / 3)


def test_slo_uses_the_p90_gap_so_one_slow_gap_in_many_passes() -> None:
    steady = tuple(1.0 + 0.01 * i for i in range(20))
    one_stall = (*steady, steady[-1] + 0.5)  # 1 slow gap of 20: below the p90
    slo = Slo(ttft_s=1.5, itl_s=0.02)
    assert meets_slo(record(sent_s=0.0, token_times_s=one_stall), slo)
    assert not meets_slo(record(sent_s=0.0, token_times_s=steady), Slo(ttft_s=0.5, itl_s=0.02))
    assert not meets_slo(record(sent_s=0.0, token_times_s=steady, error="HTTP 500"), slo)


def test_summary_counts_goodput_errors_and_rates() -> None:
    records = [
        record(sent_s=0.0, token_times_s=(0.1, 0.2, 0.3)),  # meets both SLOs
        record(sent_s=1.0, token_times_s=(1.9, 2.0, 2.1)),  # TTFT 0.9 s: misses
        record(sent_s=2.0, token_times_s=(2.1, 2.6, 3.1)),  # gaps 0.5 s: misses
        record(sent_s=3.0, token_times_s=(), error="HTTP 503"),
    ]
    summary = summarize(records, slo=Slo(ttft_s=0.5, itl_s=0.2), windows=[Window(0.0, 4.0)])
    assert (summary.requests, summary.errors) == (4, 1)
    assert summary.goodput == pytest.approx(1 / 4.0)
    assert summary.slo_attainment == pytest.approx(1 / 4)
    assert summary.request_rate == pytest.approx(3 / 4.0)
    assert summary.output_tokens_per_s == pytest.approx(9 / 4.0)
    assert summary.ttft_ms is not None and summary.ttft_ms.p50 == pytest.approx(100.0)
    assert summary.itl_ms is not None and summary.itl_ms.p50 == pytest.approx(100.0)
    assert summary.top_errors == (("HTTP 503", 1),)


def test_summary_counts_only_what_falls_inside_the_windows() -> None:
    records = [record(sent_s=0.0, token_times_s=(0.5, 1.5, 2.5)), record(sent_s=5.0, token_times_s=(5.5, 6.0))]
    summary = summarize(records, slo=Slo(ttft_s=1.0, itl_s=1.0), windows=[Window(1.0, 3.0)])
    assert summary.requests == 0  # neither was sent inside the window
    assert summary.output_tokens_per_s == pytest.approx(2 / 2.0)  # tokens at 1.5 and 2.5
    assert summary.itl_ms is not None and summary.itl_ms.p50 == pytest.approx(1000.0)


def test_summary_adds_up_several_windows_and_counts_a_gap_by_its_later_token() -> None:
    records = [record(sent_s=0.0, token_times_s=(0.5, 1.5, 2.5)), record(sent_s=5.0, token_times_s=(5.5, 6.0))]
    summary = summarize(records, slo=Slo(ttft_s=1.0, itl_s=1.0), windows=[Window(1.0, 2.0), Window(5.9, 7.0)])
    assert summary.output_tokens_per_s == pytest.approx(2 / 2.1)  # tokens at 1.5 and 6.0
    assert summary.itl_ms is not None and summary.itl_ms.p50 == pytest.approx(750.0)  # gaps of 1.0 and 0.5 s


def test_whole_run_spans_first_send_to_last_token() -> None:
    window = whole_run([record(sent_s=2.0, token_times_s=(3.0,)), record(sent_s=1.0, token_times_s=(4.0,))])
    assert window.start_s == 1.0 and window.end_s == pytest.approx(4.0)
