"""The load generator's processes: how streams are dealt, and that records come back merged."""

from __future__ import annotations

import time

import pytest

from pdserve.bench.load_processes import LoadProcesses, deal, default_load_processes
from pdserve.bench.overhead import default_upstreams
from pdserve.bench.runner import Target
from pdserve.bench.upstream import Pace, serving_upstream
from pdserve.bench.workload import COMPLETIONS, BenchRequest

TARGET = Target("t", ("http://127.0.0.1:1",))


def stream_starts_s(*, streams: int, processes: int) -> list[float]:
    shares = deal(TARGET, streams=streams, processes=processes, start_s=10.0, ramp_s=2.0, stop_s=20.0, timeout_s=1.0)
    return sorted(share.first_start_s + index * share.stagger_s / share.streams
                  for share in shares for index in range(share.streams))


@pytest.mark.parametrize(("streams", "processes"), [(8, 1), (8, 3), (2048, 8), (5, 8)])
def test_dealt_streams_start_when_one_process_would_start_them(streams: int, processes: int) -> None:
    expected = [10.0 + index * 2.0 / streams for index in range(streams)]
    assert stream_starts_s(streams=streams, processes=processes) == pytest.approx(expected)


def test_every_stream_is_dealt_once_and_shares_differ_by_at_most_one() -> None:
    shares = deal(TARGET, streams=10, processes=4, start_s=0.0, ramp_s=1.0, stop_s=5.0, timeout_s=1.0)
    assert [share.streams for share in shares] == [3, 3, 2, 2]
    assert {share.stop_s for share in shares} == {5.0}


def test_default_processes_follow_the_streams_within_the_cores() -> None:
    assert default_load_processes(256, cores=2) == 1
    assert default_load_processes(2048, cores=16) == 8
    assert default_load_processes(4096, cores=16) == 8
    assert default_load_processes(16, cores=1) == 1
    assert default_upstreams(256, cores=2) == 1
    assert default_upstreams(2048, cores=16) == 4


async def test_processes_share_a_window_and_their_records_merge() -> None:
    request = BenchRequest(COMPLETIONS, {"model": "m", "prompt": "a", "max_tokens": 5, "stream": True})
    async with serving_upstream(Pace(ttft_s=0.005, tokens_per_s=1000.0)) as upstream, \
            LoadProcesses(2, [request]) as load:
        assert len(load.processes) == 2
        start_s = time.perf_counter() + 0.05
        records = await load.run(Target("up", (upstream.url,)), streams=3, start_s=start_s, ramp_s=0.03,
                                 stop_s=start_s + 0.2, timeout_s=5.0)
    assert all(record.error is None and len(record.token_times_s) == 5 for record in records)
    assert len(records) == upstream.counts.whole >= 3
    assert min(record.sent_s for record in records) >= start_s
