"""The gateway's CPU per relayed chunk and TTFT from two source trees, side by side (docs/benchmarks.md, section 1).

Synthetic engines and load processes (this tree's) feed a gateway started from tree A,
then from tree B, in alternating windows (ABBA...); each window reads the gateway's CPU over its steady
part, counts the token events the load generator received and takes the TTFT p50 of the requests
sent in it. --handoff-ms makes the synthetic engines send a decode leg's headers at once and its first
token that much later, as a decode engine does around its KV pull. With --profile DIR, one more window per
tree runs under py-spy (all the gateway's processes, raw collapsed stacks in DIR).

    python bench/gateway_ab.py --a /tmp/before --b . --streams 128 --workers 2 --rounds 4 [--profile DIR]

--chat sends streamed chat (a shared 2048-token system prompt, turns of 256 tokens) instead of completions;
--b-env NAME=value sets B's gateway only (PDSERVE_DECODE__FIRST_TOKEN_PROCESSOR=true: these synthetic engines
write a forced first token as pdserve's logits processor makes a vLLM engine do; with
PDSERVE_DECODE__EXTRA_ARGS='[--reasoning-parser, qwen3, --tool-call-parser, hermes, --enable-auto-tool-choice]'
B's gateway also reads the chat prefill reply's message as the engines' parsers would, pd/first_delta.py).
Each window prints the gateway's CPU per chunk and per request (the requests sent in its steady part) and, after
it, the gateway's pdserve_first_tokens_total (which engine's first token each chat got, and why); the machine
(CPU model, cores, load averages) is printed at the start and at the end, and the summary gives B/A.
With --b-workers, B's gateway runs that many processes: --a and --b the same tree compare worker counts.
--disaggregation sets both gateways' routing.disaggregation (else PDSERVE_ROUTING__DISAGGREGATION, else
auto): auto serves these 64-token prompts in one leg, as `pdserve serve` decides; always through both legs.
--output-tokens below 256 weighs each request's own work more per chunk.

--keys runs B as a deployment facing clients would: client and admin API keys (the load sends the client key as
OPENAI_API_KEY, to A too, which ignores it), an engine key, and a per-key token rate high enough never to refuse,
so B pays every per-request check: key, per-key limits, the tenant's cache salt.

(with pdserve importable: installed, or PYTHONPATH=. from the repository's root).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil

from pdserve.bench.cpu import cpu_seconds, with_descendants
from pdserve.bench.load_processes import LoadProcesses
from pdserve.bench.machine import machine_state
from pdserve.bench.overhead import chunks_in
from pdserve.bench.prompts import WordPrompts
from pdserve.bench.runner import CLIENT_KEY_ENV, Target
from pdserve.bench.services import child_service, free_port, gateway_argv, synthetic_engines
from pdserve.bench.stats import Slo, Window, summarize
from pdserve.bench.workload import Lengths, shared_prefix_chat, synthetic

_NO_SLO = Slo(ttft_s=float("inf"), itl_s=float("inf"))
# --keys: fixed keys for a benchmark on loopback, never a deployment's
CLIENT_KEY, ADMIN_KEY, ENGINE_KEY = "sk-bench-client-key-0001", "sk-bench-admin-key-00001", "bench-engine-key-000001"


async def main(args: argparse.Namespace) -> None:
    output = Lengths(args.output_tokens, args.output_tokens)
    if args.chat:  # the chat: a shared 2048-token system prompt, 4 turns of 256 tokens in
        requests = shared_prefix_chat(64, model="pdserve-demo", prefix_tokens=2048, turn_tokens=Lengths(256, 256),
                                      output_tokens=output, turns=4, prompts=WordPrompts(), seed=0)
    else:
        requests = synthetic(64, model="pdserve-demo", input_tokens=Lengths(64, 64), output_tokens=output,
                             prompts=WordPrompts(), seed=0)
    per_chunk_us: dict[str, list[float]] = {"A": [], "B": []}
    per_request_us: dict[str, list[float]] = {"A": [], "B": []}
    ttft_p50_ms: dict[str, list[float]] = {"A": [], "B": []}
    if args.keys:
        os.environ[CLIENT_KEY_ENV] = CLIENT_KEY  # the load processes, started below, inherit it
        args.b_env += [f"PDSERVE_API_KEYS={CLIENT_KEY}", f"PDSERVE_ADMIN_KEY={ADMIN_KEY}",
                       f"PDSERVE_ENGINE_KEY={ENGINE_KEY}", "PDSERVE_ACCESS__PER_KEY_TOKENS_PER_MIN=1000000000"]
    print(_machine_line("start"), flush=True)
    async with contextlib.AsyncExitStack() as stack:
        upstreams = await stack.enter_async_context(synthetic_engines(
            args.upstreams, log_dir=args.logs, flags=["--handoff-ms", str(args.handoff_ms)]))
        upstream_urls = [url for url, _ in upstreams]
        load = await stack.enter_async_context(LoadProcesses(args.load_processes, requests))
        for round_index in range(args.rounds):
            for name in ("A", "B") if round_index % 2 == 0 else ("B", "A"):
                chunk_us, request_us, ttft_ms = await _window(args, name, load, upstream_urls, profile=False)
                per_chunk_us[name].append(chunk_us)
                per_request_us[name].append(request_us)
                ttft_p50_ms[name].append(ttft_ms)
        if args.profile is not None:
            for name in ("A", "B"):
                await _window(args, name, load, upstream_urls, profile=True)
    print(_machine_line("end"), flush=True)
    for name, values in per_chunk_us.items():
        print(f"{name} ({getattr(args, name.lower())}): median {statistics.median(values):.1f} us per chunk, "
              f"{statistics.median(per_request_us[name]):.0f} us per request, "
              f"TTFT p50 {statistics.median(ttft_p50_ms[name]):.2f} ms "
              f"over {len(values)} windows", flush=True)
    chunk_ratio = statistics.median(per_chunk_us["B"]) / statistics.median(per_chunk_us["A"])
    request_ratio = statistics.median(per_request_us["B"]) / statistics.median(per_request_us["A"])
    print(f"B/A: {chunk_ratio:.3f} per chunk, {request_ratio:.3f} per request (medians)", flush=True)


def _machine_line(when: str) -> str:
    state = machine_state()
    loads = ", ".join(f"{load:.2f}" for load in state["load_average"])
    return f"machine at the {when}: {state['cpu_model']}, {state['cpus']} cores, load average {loads}, {state['date']}"


async def _window(args: argparse.Namespace, name: str, load: LoadProcesses, upstream_urls: list[str], *,
                  profile: bool) -> tuple[float, float, float]:
    tree: Path = getattr(args, name.lower())
    port = free_port()
    # -P: not this working directory's pdserve, the one PYTHONPATH names
    routing = [] if args.disaggregation is None else [f"PDSERVE_ROUTING__DISAGGREGATION={args.disaggregation}"]
    routing += args.b_env if name == "B" else []
    argv = gateway_argv(upstream_urls, port=port, env=[f"PYTHONPATH={tree.resolve()}", *routing], python_flags=["-P"],
                        flags=["--workers", str(_workers(args, name))])
    async with child_service(argv, ready_url=f"http://127.0.0.1:{port}/health",
                             log_path=args.logs / f"gateway-{name}.log") as gateway:
        await asyncio.sleep(1.0)  # every worker up
        measured = await _measure(args, name, load, port, with_descendants(psutil.Process(gateway.pid)),
                                  profile=profile)
        print(f"  {name} first tokens: {await _first_tokens(port)}", flush=True)
        return measured


async def _first_tokens(port: int) -> str:
    """The gateway's pdserve_first_tokens_total series (one worker's, with several), read after the window."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}  # what a gateway with --keys asks; one without ignores it
    async with aiohttp.ClientSession(headers=admin) as session, session.get(f"http://127.0.0.1:{port}/metrics") as reply:
        text = await reply.text()
    series = [line.removeprefix("pdserve_first_tokens_total") for line in text.splitlines()
              if line.startswith("pdserve_first_tokens_total{")]
    return "; ".join(series) or "none counted"


async def _measure(args: argparse.Namespace, name: str, load: LoadProcesses, port: int,
                   processes: list[psutil.Process], *, profile: bool) -> tuple[float, float, float]:
    """The gateway's CPU per chunk and per request sent in it (µs) and TTFT p50 (ms) over one steady window."""
    start_s = time.perf_counter() + 0.05
    ramp_s = 0.02 + (args.output_tokens - 1) / 100  # one stream's lifetime: the synthetic engine's 20 ms TTFT, 100 tokens/s
    steady = Window(start_s + ramp_s, start_s + ramp_s + args.steady_s)

    async def cpu_s() -> float:
        await asyncio.sleep(steady.start_s - time.perf_counter())
        before = cpu_seconds(processes)
        spy = _py_spy(args.profile / f"pyspy-{name}-{args.streams}-streams.raw", processes[0].pid,
                      args.steady_s) if profile else None
        await asyncio.sleep(steady.end_s - time.perf_counter())
        used_s = cpu_seconds(processes) - before
        if spy is not None:
            await asyncio.to_thread(spy.wait)
        return used_s

    reading = asyncio.ensure_future(cpu_s())
    records = await load.run(Target(name, (f"http://127.0.0.1:{port}",)), streams=args.streams, start_s=start_s,
                             ramp_s=ramp_s, stop_s=steady.end_s, timeout_s=60.0)
    used_s, chunks = await reading, chunks_in(records, [steady])
    summary = summarize(records, slo=_NO_SLO, windows=[steady])
    ttft, itl = summary.ttft_ms, summary.itl_ms
    per_chunk_us = used_s / chunks * 1e6
    per_request_us = used_s / summary.requests * 1e6 if summary.requests else 0.0
    print(f"{name} {args.streams} streams, {_workers(args, name)} worker(s){' under py-spy' if profile else ''}: "
          f"{per_chunk_us:.1f} us per chunk, {per_request_us:.0f} us per request ({summary.requests} sent), "
          f"{used_s / args.steady_s:.2f} cores, {chunks / args.steady_s:.0f} chunks/s; "
          f"TTFT p50 {ttft.p50 if ttft else 0:.2f} ms, ITL p99 {itl.p99 if itl else 0:.2f} ms, {summary.errors} errors",
          flush=True)
    return per_chunk_us, per_request_us, ttft.p50 if ttft else 0.0


def _workers(args: argparse.Namespace, name: str) -> int:
    return int(args.b_workers) if name == "B" and args.b_workers is not None else int(args.workers)


def _py_spy(out: Path, pid: int, duration_s: float) -> subprocess.Popen[bytes]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([py_spy, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--format", "raw",
                             "--rate", "250", "--duration", str(int(duration_s)), "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="source tree holding pdserve/ (the 'before')")
    parser.add_argument("--b", type=Path, required=True, help="source tree holding pdserve/ (the 'after')")
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2, help="gateway processes")
    parser.add_argument("--b-workers", type=int, default=None, help="B's gateway processes (default: --workers)")
    parser.add_argument("--output-tokens", type=int, default=256, help="tokens per reply")
    parser.add_argument("--disaggregation", choices=["auto", "always", "never"], default=None,
                        help="both gateways' routing.disaggregation: always is PD, never one leg")
    parser.add_argument("--rounds", type=int, default=4, help="windows per tree")
    parser.add_argument("--chat", action="store_true", help="streamed chat with a shared prefix, not completions")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=value",
                        help="more environment for B's gateway only (a setting A's tree does not know)")
    parser.add_argument("--keys", action="store_true", help="B with client, admin and engine keys and per-key limits")
    parser.add_argument("--load-processes", type=int, default=1)
    parser.add_argument("--upstreams", type=int, default=1, help="synthetic engine processes")
    parser.add_argument("--steady-s", type=float, default=8.0)
    parser.add_argument("--handoff-ms", type=float, default=0.0,
                        help="the synthetic engines' decode leg: headers at once, its first token this much later")
    parser.add_argument("--profile", type=Path, default=None, help="folder for py-spy's stacks")
    parser.add_argument("--logs", type=Path, default=Path(".pdserve/gateway-ab"))
    arguments = parser.parse_args()
    if arguments.profile is not None:
        arguments.profile.mkdir(parents=True, exist_ok=True)
    asyncio.run(main(arguments))
