"""The load generator's CPU per token event: aiohttp's client (runner.run_closed_loop, as `bench run`
uses it) against the lean one of `bench overhead`'s load processes (streams.run_streams), same synthetic
engine, direct, in this process, windows alternated (docs/benchmarks.md, section 1).

    python bench/load_client_ab.py --streams 128 --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import uvloop

from pdserve.bench import runner
from pdserve.bench.cpu import cpu_seconds
from pdserve.bench.overhead import chunks_in
from pdserve.bench.prompts import WordPrompts
from pdserve.bench.records import RequestRecord
from pdserve.bench.services import child_service, free_port
from pdserve.bench.stats import Window
from pdserve.bench.streams import run_streams
from pdserve.bench.workload import BenchRequest, Lengths, synthetic

_RAMP_S = 2.57  # one stream lifetime: 20 ms TTFT + 255 tokens at 100/s


async def main(args: argparse.Namespace) -> None:
    requests = synthetic(64, model="pdserve-demo", input_tokens=Lengths(64, 64), output_tokens=Lengths(256, 256),
                         prompts=WordPrompts(), seed=0)
    port = free_port()
    target = runner.Target("direct", (f"http://127.0.0.1:{port}",))
    upstream = [sys.executable, "-m", "pdserve", "bench", "upstream", "--port", str(port)]
    async with child_service(upstream, ready_url=target.urls[0] + "/health", log_path=args.log), \
            runner.new_session() as session:
        for round_index in range(args.rounds):
            for client in ("aiohttp", "lean") if round_index % 2 == 0 else ("lean", "aiohttp"):
                await _window(args, client, target, itertools.cycle(requests), session)


async def _window(args: argparse.Namespace, client: str, target: runner.Target,
                  requests: Iterator[BenchRequest], session: aiohttp.ClientSession) -> None:
    steady = Window(time.perf_counter() + _RAMP_S, time.perf_counter() + _RAMP_S + args.steady_s)
    this = [psutil.Process()]

    async def cpu_s() -> float:
        await asyncio.sleep(steady.start_s - time.perf_counter())
        before = cpu_seconds(this)
        await asyncio.sleep(steady.end_s - time.perf_counter())
        return cpu_seconds(this) - before

    reading = asyncio.ensure_future(cpu_s())
    records: list[RequestRecord]
    if client == "aiohttp":
        records = await runner.run_closed_loop(
            session, target, requests, streams=args.streams, duration_s=_RAMP_S + args.steady_s, stagger_s=_RAMP_S,
            timeout_s=60.0, on_done=lambda _record: None)
    else:
        records = await run_streams(target, requests, streams=args.streams, stagger_s=_RAMP_S, stop_s=steady.end_s,
                                    timeout_s=60.0)
    used_s, events = await reading, chunks_in(records, [steady])
    print(f"{client:<8} {args.streams} streams: {used_s / events * 1e6:5.1f} us per token event "
          f"({used_s / args.steady_s:.2f} cores, {events / args.steady_s:.0f} events/s), "
          f"errors {sum(1 for record in records if record.error)}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4, help="windows per client")
    parser.add_argument("--steady-s", type=float, default=8.0)
    parser.add_argument("--log", type=Path, default=Path(".pdserve/load-client-ab/upstream.log"))
    uvloop.run(main(parser.parse_args()))
