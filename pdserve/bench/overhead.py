"""``pdserve bench overhead``: what the gateway itself costs, measured against a synthetic upstream.

Three processes: the synthetic engine, pdserve's real gateway in front of it (as both prefill
and decode engine), and this load generator. The same closed-loop load goes direct and through
the gateway in alternating windows (ABBA...), so machine noise hits both sides alike.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from pdserve.bench import runner
from pdserve.bench.prompts import WordPrompts
from pdserve.bench.records import RequestRecord
from pdserve.bench.services import child_service, free_port
from pdserve.bench.stats import Slo, Summary, Window, summarize
from pdserve.bench.workload import BenchRequest, Lengths, synthetic
from pdserve.config import DEMO_MODEL_NAME
from pdserve.errors import BenchFailed

GOAL_TTFT_P50_ADDED_MS = 2.0
GOAL_ITL_P99_ADDED_MS = 5.0
GOAL_THROUGHPUT_RATIO = 0.97
_PROMPT_TOKENS = 64
_WARM_UP_S = 2.0


@dataclass(frozen=True, slots=True)
class OverheadPlan:
    streams: int = 128
    output_tokens: int = 256
    tokens_per_s: float = 100.0  # per stream
    ttft_s: float = 0.02  # the upstream's prefill time
    duration_s: float = 20.0  # steady-state seconds per path, split over the rounds
    rounds: int = 2  # windows per path

    @property
    def stream_lifetime_s(self) -> float:
        return self.ttft_s + (self.output_tokens - 1) / self.tokens_per_s


@dataclass(frozen=True, slots=True)
class OverheadResult:
    direct: Summary
    gateway: Summary

    @property
    def ttft_p50_added_ms(self) -> float:
        assert self.direct.ttft_ms and self.gateway.ttft_ms, "measure_overhead checks both streamed"
        return self.gateway.ttft_ms.p50 - self.direct.ttft_ms.p50

    @property
    def itl_p99_added_ms(self) -> float:
        assert self.direct.itl_ms and self.gateway.itl_ms, "measure_overhead checks both streamed"
        return self.gateway.itl_ms.p99 - self.direct.itl_ms.p99

    @property
    def throughput_ratio(self) -> float:
        return self.gateway.output_tokens_per_s / self.direct.output_tokens_per_s

    @property
    def meets_goal(self) -> bool:
        """The bar of issue #3: the gateway must cost (next to) nothing."""
        return (self.ttft_p50_added_ms <= GOAL_TTFT_P50_ADDED_MS and self.itl_p99_added_ms <= GOAL_ITL_P99_ADDED_MS
                and self.throughput_ratio >= GOAL_THROUGHPUT_RATIO)

    def figures(self) -> dict[str, float | bool]:
        return {"ttft_p50_added_ms": round(self.ttft_p50_added_ms, 3),
                "itl_p99_added_ms": round(self.itl_p99_added_ms, 3),
                "throughput_ratio": round(self.throughput_ratio, 4), "meets_goal": self.meets_goal}

    def verdict(self) -> str:
        return (f"gateway adds {self.ttft_p50_added_ms:+.2f} ms TTFT p50, {self.itl_p99_added_ms:+.2f} ms inter-token "
                f"p99, and delivers {self.throughput_ratio:.1%} of direct tokens/s (goal: <= "
                f"{GOAL_TTFT_P50_ADDED_MS:g} ms, <= {GOAL_ITL_P99_ADDED_MS:g} ms, >= {GOAL_THROUGHPUT_RATIO:.0%}: "
                f"{'met' if self.meets_goal else 'NOT met'})")


async def measure_overhead(plan: OverheadPlan, *, log_dir: Path, progress: Callable[[str], None]) -> OverheadResult:
    """Stand up upstream and gateway, run ``plan`` through both paths, return both summaries."""
    async with _upstream_and_gateway(plan, log_dir=log_dir) as (direct, gateway), runner.new_session() as session:
        requests = synthetic(
            64, model=DEMO_MODEL_NAME, input_tokens=Lengths(_PROMPT_TOKENS, _PROMPT_TOKENS),
            output_tokens=Lengths(plan.output_tokens, plan.output_tokens), prompts=WordPrompts(), seed=0,
        )
        load = itertools.cycle(requests)
        records: dict[str, list[RequestRecord]] = {direct.name: [], gateway.name: []}
        windows: dict[str, list[Window]] = {direct.name: [], gateway.name: []}
        for target in (direct, gateway):  # connections and code paths warm, then measure
            await _window(session, target, load, plan=plan, steady_s=_WARM_UP_S)
        for round_index in range(plan.rounds):
            for target in (direct, gateway) if round_index % 2 == 0 else (gateway, direct):
                window, window_records = await _window(session, target, load, plan=plan,
                                                       steady_s=plan.duration_s / plan.rounds)
                records[target.name] += window_records
                windows[target.name].append(window)
                summary = summarize(window_records, slo=_NO_SLO, windows=[window])
                progress(f"  round {round_index + 1}/{plan.rounds} {target.name:<8} "
                         f"{summary.output_tokens_per_s:8.0f} tok/s  errors {summary.errors}")
    direct_summary, gateway_summary = (
        summarize(records[name], slo=_NO_SLO, windows=windows[name]) for name in (direct.name, gateway.name)
    )
    for name, summary in (("direct", direct_summary), ("gateway", gateway_summary)):
        if summary.ttft_ms is None or summary.itl_ms is None:
            raise BenchFailed(f"{name}: no request streamed tokens ({summary.errors} errors: {summary.top_errors}); "
                              f"logs in {log_dir}")
    return OverheadResult(direct=direct_summary, gateway=gateway_summary)


_NO_SLO = Slo(ttft_s=float("inf"), itl_s=float("inf"))


async def _window(
    session: aiohttp.ClientSession, target: runner.Target, load: Iterator[BenchRequest], *,
    plan: OverheadPlan, steady_s: float,
) -> tuple[Window, list[RequestRecord]]:
    """Ramp ``plan.streams`` up over one stream lifetime, then hold them for ``steady_s``."""
    ramp_s = plan.stream_lifetime_s
    start_s = time.perf_counter()
    records = await runner.run_closed_loop(
        session, target, load, streams=plan.streams, duration_s=ramp_s + steady_s, stagger_s=ramp_s,
        timeout_s=ramp_s * 10 + 30.0, on_done=lambda _record: None,
    )
    return Window(start_s + ramp_s, start_s + ramp_s + steady_s), records


@contextlib.asynccontextmanager
async def _upstream_and_gateway(
    plan: OverheadPlan, *, log_dir: Path
) -> AsyncIterator[tuple[runner.Target, runner.Target]]:
    upstream_port, gateway_port = free_port(), free_port()
    upstream_url, gateway_url = f"http://127.0.0.1:{upstream_port}", f"http://127.0.0.1:{gateway_port}"
    pdserve = [sys.executable, "-m", "pdserve"]
    upstream_argv = [*pdserve, "bench", "upstream", "--port", str(upstream_port),
                     "--ttft-ms", str(plan.ttft_s * 1000), "--tokens-per-s", str(plan.tokens_per_s)]
    gateway_argv = [*pdserve, "serve", "--prefill-url", upstream_url, "--decode-url", upstream_url,
                    "--port", str(gateway_port)]
    async with (
        child_service(upstream_argv, ready_url=f"{upstream_url}/health", log_path=log_dir / "upstream.log"),
        child_service(gateway_argv, ready_url=f"{gateway_url}/health", log_path=log_dir / "gateway.log"),
    ):
        yield runner.Target("direct", (upstream_url,)), runner.Target("gateway", (gateway_url,))
