"""``pdserve bench overhead``: what the gateway itself costs, measured against a synthetic upstream.

Three parts, each in processes of its own: the synthetic engines, pdserve's real gateway in front
of them (as both prefill and decode engines), and the load generator (bench/load_processes.py).
The same closed-loop load goes direct and through the gateway in alternating windows (ABBA...),
so machine noise hits both sides alike. Each part's CPU is read from its processes' own counters
over every window (bench/cpu.py): the gateway's per relayed chunk, the other two to show they
were not what ran out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from bisect import bisect_left
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from pdserve.bench import runner
from pdserve.bench.cpu import CpuMeter, CpuUse, cpu_use, per_item_us, summed, with_descendants
from pdserve.bench.hosts import Hosts, confined
from pdserve.bench.load_processes import LoadProcesses
from pdserve.bench.prompts import WordPrompts
from pdserve.bench.records import RequestRecord
from pdserve.bench.services import child_service, free_port, gateway_argv, synthetic_engines
from pdserve.bench.stats import Slo, Summary, Window, summarize
from pdserve.bench.workload import Lengths, synthetic
from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve.errors import BenchFailed
from pdserve.pd import native_relay

GOAL_TTFT_P50_ADDED_MS = 2.0
GOAL_ITL_P99_ADDED_MS = 5.0
GOAL_THROUGHPUT_RATIO = 0.97
# The gateway processes' relay threads, counted apart too: per chunk they do what a compiled proxy does.
RELAY_THREADS = {"relay_thread": ("gateway", native_relay.THREAD_NAME)}
_PROMPT_TOKENS = 64
_WARM_UP_S = 2.0
_STREAMS_PER_UPSTREAM = 512


@dataclass(frozen=True, slots=True)
class OverheadPlan:
    streams: int = 128
    output_tokens: int = 256
    tokens_per_s: float = 100.0  # per stream
    ttft_s: float = 0.02  # the upstream's prefill time
    duration_s: float = 20.0  # steady-state seconds per path, split over the rounds
    rounds: int = 2  # windows per path
    gateway_workers: int | None = None  # None: the gateway's default (the cores available)
    load_processes: int = 1  # the load generator's processes, each with a share of the streams
    upstreams: int = 1  # synthetic engine processes, each its own port; the gateway sees them as a pool
    gateways: int = 1  # separate gateways, each its own port; the streams go round-robin over them
    hosts: Hosts | None = None  # each gateway on cores of its own and the other parts on the rest; None: shared

    def __post_init__(self) -> None:
        assert self.hosts is None or len(self.hosts.gateways) == self.gateways, "one core set per gateway"

    @property
    def stream_lifetime_s(self) -> float:
        return self.ttft_s + (self.output_tokens - 1) / self.tokens_per_s


@dataclass(frozen=True, slots=True)
class PathCpu:
    """What each part used while one path carried the load (steady windows only)."""

    uses: dict[str, CpuUse]  # by part (all its processes): gateway, upstream, loadgen
    chunks: int  # token events the load generator received: one relayed chunk each
    requests: int  # sent inside the windows

    def us_per_chunk(self, process: str) -> float | None:
        """None also where the part was not measured (``relay_thread`` without RELAY_THREADS)."""
        return per_item_us(self.uses[process].seconds, self.chunks) if process in self.uses else None

    def us_per_request(self, process: str) -> float | None:
        return per_item_us(self.uses[process].seconds, self.requests)


@dataclass(frozen=True, slots=True)
class OverheadResult:
    streams: int
    direct: Summary
    gateway: Summary
    direct_cpu: PathCpu
    gateway_cpu: PathCpu

    @property
    def ttft_p50_added_ms(self) -> float:
        assert self.direct.ttft_ms and self.gateway.ttft_ms, "measure_sweep checks both streamed"
        return self.gateway.ttft_ms.p50 - self.direct.ttft_ms.p50

    @property
    def itl_p99_added_ms(self) -> float:
        assert self.direct.itl_ms and self.gateway.itl_ms, "measure_sweep checks both streamed"
        return self.gateway.itl_ms.p99 - self.direct.itl_ms.p99

    @property
    def throughput_ratio(self) -> float:
        return self.gateway.output_tokens_per_s / self.direct.output_tokens_per_s

    @property
    def meets_goal(self) -> bool:
        """The bar of issue #3: the gateway must cost (next to) nothing."""
        return (self.ttft_p50_added_ms <= GOAL_TTFT_P50_ADDED_MS and self.itl_p99_added_ms <= GOAL_ITL_P99_ADDED_MS
                and self.throughput_ratio >= GOAL_THROUGHPUT_RATIO)

    def figures(self) -> dict[str, object]:
        cpu = self.gateway_cpu
        return {"streams": self.streams, "ttft_p50_added_ms": round(self.ttft_p50_added_ms, 3),
                "itl_p99_added_ms": round(self.itl_p99_added_ms, 3),
                "throughput_ratio": round(self.throughput_ratio, 4), "meets_goal": self.meets_goal,
                "gateway_cpu_us_per_chunk": _rounded(cpu.us_per_chunk("gateway")),
                "gateway_cpu_us_per_request": _rounded(cpu.us_per_request("gateway")),
                "relay_thread_cpu_us_per_chunk": _rounded(cpu.us_per_chunk("relay_thread")),
                "cores": {path: {name: round(use.cores, 3) for name, use in path_cpu.uses.items()}
                          for path, path_cpu in (("direct", self.direct_cpu), ("gateway", cpu))},
                "busiest_process_cores": {
                    path: {name: round(use.busiest_cores, 3) for name, use in path_cpu.uses.items()}
                    for path, path_cpu in (("direct", self.direct_cpu), ("gateway", cpu))},
                "chunks_per_s": round(cpu.chunks / cpu.uses["gateway"].window_s, 1)}

    def verdict(self) -> str:
        return (f"gateway adds {self.ttft_p50_added_ms:+.2f} ms TTFT p50, {self.itl_p99_added_ms:+.2f} ms inter-token "
                f"p99, and delivers {self.throughput_ratio:.1%} of direct tokens/s (goal: <= "
                f"{GOAL_TTFT_P50_ADDED_MS:g} ms, <= {GOAL_ITL_P99_ADDED_MS:g} ms, >= {GOAL_THROUGHPUT_RATIO:.0%}: "
                f"{'met' if self.meets_goal else 'NOT met'})")

    def cpu_line(self) -> str:
        cpu, direct = self.gateway_cpu, self.direct_cpu
        per_chunk, per_request = cpu.us_per_chunk("gateway"), cpu.us_per_request("gateway")
        cores = ", ".join(f"{name} {use.cores:.2f} (busiest process {use.busiest_cores:.2f})"
                          for name, use in cpu.uses.items() if name not in RELAY_THREADS)  # in the gateway's
        in_thread = cpu.us_per_chunk("relay_thread")
        of_it = f" ({in_thread:.1f} in its relay threads)" if in_thread else ""
        return (f"gateway CPU {per_chunk or 0:.1f} us per relayed chunk{of_it}, {per_request or 0:.0f} us per request "
                f"({cpu.chunks / cpu.uses['gateway'].window_s:.0f} chunks/s); cores busy through the gateway: "
                f"{cores}; direct: upstream {direct.uses['upstream'].cores:.2f}, "
                f"loadgen {direct.uses['loadgen'].cores:.2f}")


def default_upstreams(streams: int, *, cores: int) -> int:
    """One synthetic engine per 512 streams (~14 us of its CPU per token: 0.7 of a core at 100
    tokens/s), on at most a quarter of the cores, and at least one. Pure."""
    return max(1, min(cores // 4, math.ceil(streams / _STREAMS_PER_UPSTREAM)))


def knee_streams(outcomes: Sequence[tuple[int, bool]]) -> int | None:
    """The highest stream count at which every run, of it and of every lower count, met all
    three goals; None when the lowest already missed. ``outcomes``: (streams, met) per run. Pure.
    """
    met: dict[int, bool] = {}
    for streams, is_met in outcomes:
        met[streams] = met.get(streams, True) and is_met
    knee = None
    for streams in sorted(met):
        if not met[streams]:
            break
        knee = streams
    return knee


def saturated(result: OverheadResult, *, busy_cores: float = 0.9) -> list[str]:
    """The parts other than the gateway with a process that kept a core busy: the figures then
    measure them, not the gateway. Pure."""
    return sorted({name for path in (result.direct_cpu, result.gateway_cpu)
                   for name, use in path.uses.items() if name != "gateway" and use.busiest_cores >= busy_cores})


def missed_with_room(result: OverheadResult, *, busy_cores: float = 0.75) -> float | None:
    """How busy the gateway's busiest process was, where the point missed its goals although that
    process had room and no other part was saturated: a stall set the point, not the gateway's
    cores filling (on some machines one gateway on one core misses from a quarter of its knee:
    docs/benchmarks.md, section 1). None otherwise. Pure."""
    if result.meets_goal or saturated(result):
        return None
    busiest = result.gateway_cpu.uses["gateway"].busiest_cores
    return busiest if busiest < busy_cores else None


async def measure_sweep(
    levels: Sequence[int], plan: OverheadPlan, *, repeats: int, log_dir: Path, progress: Callable[[str], None],
) -> list[OverheadResult]:
    """Stand up upstreams, gateways and load processes once, run ``plan`` at each stream count ``repeats`` times."""
    results: list[OverheadResult] = []
    requests = synthetic(
        64, model=DEMO_MODEL_NAME, input_tokens=Lengths(_PROMPT_TOKENS, _PROMPT_TOKENS),
        output_tokens=Lengths(plan.output_tokens, plan.output_tokens), prompts=WordPrompts(), seed=0,
    )
    with confined(plan.hosts.rest if plan.hosts else None):  # the processes started in here inherit it
        async with (
            _upstreams_and_gateways(plan, log_dir=log_dir) as (direct, gateway, services),
            LoadProcesses(plan.load_processes, requests) as load,
        ):
            meter = CpuMeter({**services, "loadgen": [psutil.Process(), *load.processes]}, named_threads=RELAY_THREADS)
            warm_up = dataclasses.replace(plan, streams=min(levels))
            for target in (direct, gateway):  # connections and code paths warm, then measure
                await _window(load, target, plan=warm_up, steady_s=_WARM_UP_S, meter=meter)
            for streams in levels:
                for repeat in range(repeats):
                    progress(f"{streams} streams, run {repeat + 1}/{repeats}")
                    point = dataclasses.replace(plan, streams=streams)
                    results.append(await _measure_point(load, direct, gateway, plan=point, meter=meter,
                                                        progress=progress, log_dir=log_dir))
                    progress("  " + results[-1].verdict())
                    progress("  " + results[-1].cpu_line())
    return results


async def _measure_point(
    load: LoadProcesses, direct: runner.Target, gateway: runner.Target, *,
    plan: OverheadPlan, meter: CpuMeter, progress: Callable[[str], None], log_dir: Path,
) -> OverheadResult:
    paths = await measure_paths(load, [direct, gateway], plan=plan, meters={direct.name: meter, gateway.name: meter},
                                progress=progress, log_dir=log_dir)
    return OverheadResult(streams=plan.streams, direct=paths[direct.name][0], gateway=paths[gateway.name][0],
                          direct_cpu=paths[direct.name][1], gateway_cpu=paths[gateway.name][1])


async def measure_paths(
    load: LoadProcesses, targets: Sequence[runner.Target], *, plan: OverheadPlan, meters: Mapping[str, CpuMeter],
    progress: Callable[[str], None], log_dir: Path,
) -> dict[str, tuple[Summary, PathCpu]]:
    """The same load through each of ``targets`` in turn, ``plan.rounds`` windows each, the order
    reversed every other round (ABBA...); each target's summary and its parts' CPU (read with
    ``meters[target.name]``) over its windows."""
    records: dict[str, list[RequestRecord]] = {target.name: [] for target in targets}
    windows: dict[str, list[Window]] = {target.name: [] for target in targets}
    uses: dict[str, list[dict[str, CpuUse]]] = {target.name: [] for target in targets}
    for round_index in range(plan.rounds):
        for target in targets if round_index % 2 == 0 else reversed(targets):
            window, window_records, window_use = await _window(
                load, target, plan=plan, steady_s=plan.duration_s / plan.rounds, meter=meters[target.name])
            records[target.name] += window_records
            windows[target.name].append(window)
            uses[target.name].append(window_use)
            chunks = chunks_in(window_records, [window])
            errors = sum(1 for record in window_records if record.error is not None and record.sent_s in window)
            progress(f"  round {round_index + 1}/{plan.rounds} {target.name:<8} "
                     f"{chunks / window.length_s:8.0f} token events/s  errors {errors}")
    paths = {}
    for name, path_records in records.items():
        summary = summarize(path_records, slo=_NO_SLO, windows=windows[name])
        if summary.ttft_ms is None or summary.itl_ms is None:
            raise BenchFailed(f"{name}: no request streamed tokens ({summary.errors} errors: {summary.top_errors}); "
                              f"logs in {log_dir}")
        cpu = PathCpu(uses={process: summed([use[process] for use in uses[name]]) for process in uses[name][0]},
                      chunks=chunks_in(path_records, windows[name]), requests=summary.requests)
        paths[name] = (summary, cpu)
    return paths


def chunks_in(records: Sequence[RequestRecord], windows: Sequence[Window]) -> int:
    """Token events that arrived inside ``windows`` (each record's times are in order). Pure."""
    return sum(bisect_left(record.token_times_s, window.end_s) - bisect_left(record.token_times_s, window.start_s)
               for record in records for window in windows)


_NO_SLO = Slo(ttft_s=float("inf"), itl_s=float("inf"))
_START_LEAD_S = 0.05  # for the load processes to get their shares before the window starts


async def _window(
    load: LoadProcesses, target: runner.Target, *, plan: OverheadPlan, steady_s: float, meter: CpuMeter,
) -> tuple[Window, list[RequestRecord], dict[str, CpuUse]]:
    """Ramp ``plan.streams`` up over one stream lifetime, then hold them for ``steady_s``; the
    processes' CPU is read at both ends of the steady part."""
    ramp_s = plan.stream_lifetime_s
    start_s = time.perf_counter() + _START_LEAD_S
    steady = Window(start_s + ramp_s, start_s + ramp_s + steady_s)
    async with asyncio.TaskGroup() as group:
        cpu = group.create_task(_cpu_between(meter, start_s=steady.start_s, end_s=steady.end_s))
        records = await load.run(target, streams=plan.streams, start_s=start_s, ramp_s=ramp_s,
                                 stop_s=steady.end_s, timeout_s=ramp_s * 10 + 30.0)
    return steady, records, cpu.result()


async def _cpu_between(meter: CpuMeter, *, start_s: float, end_s: float) -> dict[str, CpuUse]:
    """Each part's CPU from ``start_s`` to ``end_s`` (time.perf_counter()); read off the loop."""
    await asyncio.sleep(max(0.0, start_s - time.perf_counter()))
    before, read_from_s = await asyncio.to_thread(meter.read), time.perf_counter()
    await asyncio.sleep(max(0.0, end_s - time.perf_counter()))
    after, read_to_s = await asyncio.to_thread(meter.read), time.perf_counter()
    return cpu_use(before, after, window_s=read_to_s - read_from_s)


@contextlib.asynccontextmanager
async def _upstreams_and_gateways(
    plan: OverheadPlan, *, log_dir: Path
) -> AsyncIterator[tuple[runner.Target, runner.Target, dict[str, list[psutil.Process]]]]:
    """``plan.upstreams`` synthetic engines and ``plan.gateways`` gateways over them, each on its
    own cores where ``plan.hosts`` says; yields the direct and gateway targets and each part's
    processes (every gateway with its workers)."""
    pace = ["--ttft-ms", str(plan.ttft_s * 1000), "--tokens-per-s", str(plan.tokens_per_s)]
    workers = [] if plan.gateway_workers is None else ["--workers", str(plan.gateway_workers)]
    async with contextlib.AsyncExitStack() as stack:
        upstreams = await stack.enter_async_context(synthetic_engines(plan.upstreams, log_dir=log_dir, flags=pace))
        upstream_urls = [url for url, _ in upstreams]
        gateway_urls, gateway_processes = [], []
        for index in range(plan.gateways):
            port = free_port()
            gateway_urls.append(f"http://127.0.0.1:{port}")
            gateway = await stack.enter_async_context(child_service(
                gateway_argv(upstream_urls, port=port, flags=workers),
                ready_url=f"{gateway_urls[-1]}/health", log_path=log_dir / f"gateway-{index}.log",
                cores=plan.hosts.gateways[index] if plan.hosts else ()))
            gateway_processes += with_descendants(psutil.Process(gateway.pid))
        services = {"gateway": gateway_processes,
                    "upstream": [psutil.Process(process.pid) for _, process in upstreams]}
        yield runner.Target("direct", tuple(upstream_urls)), runner.Target("gateway", tuple(gateway_urls)), services


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
