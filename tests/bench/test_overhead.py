from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from pdserve.bench.cpu import CpuMeter, CpuUse, cpu_use, per_item_us, summed, with_descendants
from pdserve.bench.load_processes import LoadProcesses
from pdserve.bench.overhead import (
    OverheadPlan,
    OverheadResult,
    PathCpu,
    chunks_in,
    knee_streams,
    measure_paths,
    missed_with_room,
    saturated,
)
from pdserve.bench.prompts import WordPrompts
from pdserve.bench.records import RequestRecord
from pdserve.bench.runner import Target
from pdserve.bench.services import BENCH_GATEWAY_ENV
from pdserve.bench.stats import Percentiles, Summary, Window
from pdserve.bench.upstream import Pace, serving_upstream
from pdserve.bench.workload import Lengths, synthetic
from pdserve.config import load_settings
from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve.pd import native_relay


def test_knee_is_the_highest_count_before_the_first_miss() -> None:
    assert knee_streams([(16, True), (64, True), (128, False), (256, True)]) == 64


def test_knee_needs_every_run_of_a_count_to_meet_the_goals() -> None:
    outcomes = [(64, True), (16, True), (128, True), (64, True), (128, False), (16, True)]
    assert knee_streams(outcomes) == 64


def test_no_knee_when_the_lowest_count_misses() -> None:
    assert knee_streams([(16, False), (64, True)]) is None
    assert knee_streams([]) is None


def test_cpu_use_is_the_difference_over_the_window() -> None:
    uses = cpu_use({"gateway": (10.0,), "loadgen": (3.0, 1.0)}, {"gateway": (10.5,), "loadgen": (4.0, 1.5)},
                   window_s=2.0)
    assert uses["gateway"].cores == pytest.approx(0.25)
    assert uses["loadgen"].cores == pytest.approx(0.75)  # both its processes
    assert uses["loadgen"].busiest_cores == pytest.approx(0.5)
    assert summed([CpuUse(1.0, 2.0, 0.5), CpuUse(3.0, 2.0, 0.75)]) == CpuUse(4.0, 4.0, 0.75)


def test_a_part_is_saturated_when_one_of_its_processes_is() -> None:
    spread = {"gateway": CpuUse(9.0, 10.0, 0.9), "upstream": CpuUse(8.0, 10.0, 0.2), "loadgen": CpuUse(5.0, 10.0, 0.5)}
    one_busy = spread | {"upstream": CpuUse(9.5, 10.0, 0.95)}
    summary = Summary(requests=1, errors=0, duration_s=10.0, request_rate=0.1, output_tokens_per_s=1.0, goodput=0.1,
                      slo_attainment=1.0, ttft_ms=None, itl_ms=None, tpot_ms=None, e2e_ms=None)
    def result(uses: dict[str, CpuUse]) -> OverheadResult:
        cpu = PathCpu(uses=uses, chunks=1, requests=1)
        return OverheadResult(streams=1, direct=summary, gateway=summary, direct_cpu=cpu, gateway_cpu=cpu)
    assert saturated(result(spread)) == []  # 0.8 cores of upstream, spread over processes
    assert saturated(result(one_busy)) == ["upstream"]


def test_a_miss_with_the_gateway_half_idle_is_told_apart_from_its_cores_filling() -> None:
    def point(*, itl_p99_ms: float, gateway_busiest: float, upstream_busiest: float = 0.3) -> OverheadResult:
        def summary(itl_p99: float) -> Summary:
            return Summary(requests=10, errors=0, duration_s=10.0, request_rate=1.0, output_tokens_per_s=100.0,
                           goodput=1.0, slo_attainment=1.0, ttft_ms=Percentiles(21.0, 22.0, 23.0),
                           itl_ms=Percentiles(10.0, 10.5, itl_p99), tpot_ms=None, e2e_ms=None)
        uses = {"gateway": CpuUse(5.0, 10.0, gateway_busiest), "upstream": CpuUse(3.0, 10.0, upstream_busiest),
                "loadgen": CpuUse(3.0, 10.0, 0.3)}
        cpu = PathCpu(uses=uses, chunks=1000, requests=10)
        return OverheadResult(streams=256, direct=summary(11.0), gateway=summary(itl_p99_ms),
                              direct_cpu=cpu, gateway_cpu=cpu)

    assert missed_with_room(point(itl_p99_ms=21.0, gateway_busiest=0.52)) == pytest.approx(0.52)
    assert missed_with_room(point(itl_p99_ms=12.0, gateway_busiest=0.52)) is None  # +1 ms: the goals held
    assert missed_with_room(point(itl_p99_ms=21.0, gateway_busiest=0.95)) is None  # its core filled: a knee
    assert missed_with_room(point(itl_p99_ms=21.0, gateway_busiest=0.52, upstream_busiest=0.95)) is None  # said apart


def test_a_benchmark_gateway_does_not_hold_legs_back_from_the_synthetic_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().gateway.max_in_flight_per_engine == 256  # vLLM's batch limit, which they lack
    for assignment in BENCH_GATEWAY_ENV:
        monkeypatch.setenv(*assignment.split("=", 1))
    assert load_settings().gateway.max_in_flight_per_engine >= 100_000


def test_cpu_per_chunk_and_request_in_microseconds() -> None:
    assert per_item_us(0.5, 10_000) == pytest.approx(50.0)
    assert per_item_us(0.5, 0) is None
    path = PathCpu(uses={"gateway": CpuUse(0.2, 10.0)}, chunks=4_000, requests=10)
    assert path.us_per_chunk("gateway") == pytest.approx(50.0)
    assert path.us_per_request("gateway") == pytest.approx(20_000.0)


def test_meter_reads_the_process_own_counters() -> None:
    meter = CpuMeter({"loadgen": [psutil.Process()]})
    before = meter.read()
    deadline_s = time.process_time() + 0.2
    while time.process_time() < deadline_s:
        pass
    used_s = meter.read()["loadgen"][0] - before["loadgen"][0]
    assert 0.15 <= used_s < 1.0


PR_SET_NAME = 15  # linux/prctl.h


def test_meter_counts_named_threads_apart_as_a_group_of_their_own() -> None:
    """The gateway's relay threads are told apart by name, as `top -H` shows them (bench/cpu.py)."""
    spun, stop = threading.Event(), threading.Event()

    def spin() -> None:  # until read: an ended thread's time is no longer in /proc/PID/task
        ctypes.CDLL(None).prctl(PR_SET_NAME, b"spinning-test", 0, 0, 0)  # names the calling thread
        started_s = time.thread_time()
        while not stop.is_set():
            # 0.3 s of its own time before the read, which /proc counts in clock ticks and may lag a tick or two
            # (0.19 read after 0.2 on a loaded machine)
            if time.thread_time() - started_s >= 0.3:
                spun.set()

    meter = CpuMeter({"this": [psutil.Process()]}, named_threads={
        "spinning": ("this", "spinning-test"), "relay": ("this", native_relay.THREAD_NAME), "none": ("this", None)})
    before = meter.read()
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        assert spun.wait(30), "the thread never ran 0.3 s"
        during = meter.read()
    finally:
        stop.set()
        spinner.join()
    assert during["spinning"][0] - before["spinning"][0] >= 0.2
    assert during["relay"] == during["none"] == (0.0,)  # no relay thread here, and no name asked for


async def test_the_relay_thread_carries_its_name() -> None:
    relay = native_relay.start((0.01,), enabled=True)
    assert relay is not None, "the C relay is built by make setup"
    try:
        names = [path.read_text().strip() for path in Path("/proc/self/task").glob("*/comm")]
    finally:
        relay.close()
    assert names.count(native_relay.THREAD_NAME) == 1


def test_meter_counts_a_child_only_where_it_is_listed() -> None:
    """The load generator starts the services it measures: their CPU must not count as its own."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        this = psutil.Process()
        meter = CpuMeter({"loadgen": [this], "service": [psutil.Process(busy.pid)],
                          "tree": with_descendants(this)})
        before = after = meter.read()
        deadline_s = time.monotonic() + 30.0
        while sum(after["service"]) - sum(before["service"]) < 0.3 and time.monotonic() < deadline_s:
            time.sleep(0.05)
            after = meter.read()
    finally:
        busy.kill()
        busy.wait()
    assert sum(after["service"]) - sum(before["service"]) >= 0.3
    assert sum(after["loadgen"]) - sum(before["loadgen"]) < 0.2
    assert sum(after["tree"]) - sum(before["tree"]) >= 0.25


def test_chunks_count_only_token_events_inside_the_windows() -> None:
    record = RequestRecord(target="gateway", url="u", sent_s=0.0, token_times_s=(0.5, 1.5, 2.5, 3.5),
                           done_s=4.0, output_tokens=4)
    assert chunks_in([record], [Window(1.0, 3.0)]) == 2
    assert chunks_in([record], [Window(0.0, 1.0), Window(3.0, 4.0)]) == 2


async def test_measure_paths_runs_each_target_in_turn_and_reads_each_parts_cpu(tmp_path: Path) -> None:
    """Two names for one synthetic engine, measured for real: windows alternate A B B A, each
    path's tokens arrive inside its windows, and the CPU each part used is read per path."""
    requests = synthetic(8, model=DEMO_MODEL_NAME, input_tokens=Lengths(16, 16), output_tokens=Lengths(20, 20),
                         prompts=WordPrompts(), seed=0)
    # Enough chunks that each part's CPU spans several of the kernel's 10 ms ticks: at 2 streams
    # the load process used under one tick per path on a 2-core CI machine and read 0.0.
    plan = OverheadPlan(streams=8, output_tokens=20, tokens_per_s=200.0, duration_s=1.2, rounds=2)
    order: list[str] = []
    async with serving_upstream(Pace(ttft_s=0.01, tokens_per_s=plan.tokens_per_s)) as upstream, \
            LoadProcesses(1, requests) as load:
        meter = CpuMeter({"gateway": [], "upstream": [psutil.Process()], "loadgen": list(load.processes)})
        targets = [Target("a", (upstream.url,)), Target("b", (upstream.url,))]
        paths = await measure_paths(load, targets, plan=plan, meters={"a": meter, "b": meter},
                                    progress=lambda line: order.append(line.split()[2]), log_dir=tmp_path)
    assert order == ["a", "b", "b", "a"]
    for summary, cpu in paths.values():
        assert summary.requests >= 2 and summary.errors == 0
        assert cpu.chunks >= plan.streams * plan.tokens_per_s * plan.duration_s * 0.5, "half of what the streams carry"
        assert cpu.uses["upstream"].seconds > 0 and cpu.uses["loadgen"].seconds > 0
        assert cpu.uses["gateway"].seconds == 0
