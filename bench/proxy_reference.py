"""pdserve's gateway beside nginx, a compiled proxy, on one synthetic engine and one load (docs/benchmarks.md, section 1).

Four paths in alternating windows (ABCD, DCBA, ...), each part in processes of its own:
- direct: the load generator talks to the synthetic engine;
- nginx: one leg, the whole request relayed (keep-alive upstream, proxy_buffering off, its workers = --workers);
- pdserve-1leg: pdserve's gateway with routing.disaggregation never, the same hops as nginx;
- pdserve-pd: pdserve's gateway as deployed, two legs (prefill, then decode) where the others have one.
Each proxy's added TTFT p50 and inter-token p99, its share of direct tokens/s, and its CPU per relayed
chunk, read from its processes' counters: what a compiled relay costs on the same machine, beside ours.

    python bench/proxy_reference.py --streams 16,128,256 --workers 2 --rounds 2 --duration 10

--output-tokens (256 by default) sets each reply's length: CPU per chunk at two lengths splits into
a part per chunk and a part per request (docs/benchmarks.md, section 1).

(with pdserve importable: installed, or PYTHONPATH=. from the repository's root). nginx is Debian's
(`apt-get install nginx-light`); nothing else in the repository needs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import psutil

from pdserve.bench.cpu import CpuMeter, with_descendants
from pdserve.bench.load_processes import LoadProcesses
from pdserve.bench.overhead import RELAY_THREADS, OverheadPlan, OverheadResult, measure_paths
from pdserve.bench.prompts import WordPrompts
from pdserve.bench.runner import Target
from pdserve.bench.services import child_service, free_port, gateway_argv, synthetic_engines
from pdserve.bench.workload import Lengths, synthetic

GOAL_TTFT_P50_ABOVE_NGINX_MS = 1.5  # issue #26, criterion 5: pdserve-pd against nginx in one run
GOAL_CPU_PER_CHUNK_OF_NGINX = 1.4

_NGINX_CONF = """worker_processes {workers};
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {folder}/body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    keepalive_requests 1000000;
    upstream engine {{
{servers}
        keepalive 4096;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


async def main(args: argparse.Namespace) -> None:
    levels = [int(value) for value in args.streams.split(",")]
    requests = synthetic(64, model="pdserve-demo", input_tokens=Lengths(64, 64), output_tokens=Lengths(args.output_tokens, args.output_tokens),
                         prompts=WordPrompts(), seed=0)
    plan = OverheadPlan(duration_s=args.duration, rounds=args.rounds)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; nginx and pdserve with {args.workers} "
          f"worker(s) each, {args.upstreams} synthetic engine(s), {args.load_processes} load process(es)", flush=True)
    results: dict[str, list[OverheadResult]] = {"nginx": [], "pdserve-1leg": [], "pdserve-pd": []}
    async with contextlib.AsyncExitStack() as stack:
        started = await stack.enter_async_context(synthetic_engines(args.upstreams, log_dir=args.logs))
        engine_urls = [url for url, _ in started]
        engines = [psutil.Process(process.pid) for _, process in started]
        proxies = {
            "nginx": await stack.enter_async_context(_nginx(args, engine_urls)),
            "pdserve-1leg": await stack.enter_async_context(_pdserve(args, engine_urls, disaggregation="never")),
            "pdserve-pd": await stack.enter_async_context(_pdserve(args, engine_urls, disaggregation="always")),
        }
        load = await stack.enter_async_context(LoadProcesses(args.load_processes, requests))
        loadgen = [psutil.Process(), *load.processes]
        direct = Target("direct", tuple(engine_urls))
        targets = [direct, *(Target(name, (url,)) for name, (url, _) in proxies.items())]
        meters = {name: CpuMeter({"gateway": processes, "upstream": engines, "loadgen": loadgen},
                                 named_threads=RELAY_THREADS)
                  for name, (_, processes) in proxies.items()}
        meters["direct"] = CpuMeter({"gateway": [], "upstream": engines, "loadgen": loadgen})
        for streams in levels:
            print(f"{streams} streams", flush=True)
            point = dataclasses.replace(plan, streams=streams)
            paths = await measure_paths(load, targets, plan=point, meters=meters, progress=print, log_dir=args.logs)
            for name, points in results.items():
                result = OverheadResult(streams=streams, direct=paths["direct"][0], gateway=paths[name][0],
                                        direct_cpu=paths["direct"][1], gateway_cpu=paths[name][1])
                points.append(result)
                print(f"  {name:<13} {result.verdict()}\n  {'':<13} {result.cpu_line()}", flush=True)
            print(f"  {_against_nginx(results['pdserve-pd'][-1], results['nginx'][-1])}", flush=True)
    print(json.dumps({name: [result.figures() for result in points] for name, points in results.items()}))


def _against_nginx(pd: OverheadResult, nginx: OverheadResult) -> str:
    """Issue #26's bar, read off one point so that no one works it out by hand from the lines above."""
    ttft_above = pd.ttft_p50_added_ms - nginx.ttft_p50_added_ms
    cpu_ratio = (pd.gateway_cpu.us_per_chunk("gateway") or 0) / (nginx.gateway_cpu.us_per_chunk("gateway") or 1)
    met = ttft_above <= GOAL_TTFT_P50_ABOVE_NGINX_MS and cpu_ratio <= GOAL_CPU_PER_CHUNK_OF_NGINX
    return (f"pdserve-pd against nginx: {ttft_above:+.2f} ms TTFT p50, {cpu_ratio:.2f}x its CPU per chunk (goal: <= "
            f"{GOAL_TTFT_P50_ABOVE_NGINX_MS:g} ms, <= {GOAL_CPU_PER_CHUNK_OF_NGINX:g}x: {'met' if met else 'NOT met'})")


@contextlib.asynccontextmanager
async def _nginx(args: argparse.Namespace, engine_urls: list[str]) -> AsyncIterator[tuple[str, list[psutil.Process]]]:
    port = free_port()
    servers = "\n".join(f"        server {url.removeprefix('http://')};" for url in engine_urls)
    with tempfile.TemporaryDirectory(prefix="pdserve-nginx-") as folder:
        conf = Path(folder) / "nginx.conf"
        conf.write_text(_NGINX_CONF.format(workers=args.workers, folder=folder, servers=servers, port=port))
        argv = [args.nginx, "-p", folder, "-e", f"{folder}/error.log", "-c", str(conf)]
        async with child_service(argv, ready_url=f"http://127.0.0.1:{port}/health",
                                 log_path=args.logs / "nginx.log") as process:
            yield f"http://127.0.0.1:{port}", with_descendants(psutil.Process(process.pid))


@contextlib.asynccontextmanager
async def _pdserve(args: argparse.Namespace, engine_urls: list[str], *,
                   disaggregation: str) -> AsyncIterator[tuple[str, list[psutil.Process]]]:
    port = free_port()
    argv = gateway_argv(engine_urls, port=port, env=[f"PDSERVE_ROUTING__DISAGGREGATION={disaggregation}"],
                        flags=["--workers", str(args.workers)])
    async with child_service(argv, ready_url=f"http://127.0.0.1:{port}/health/ready",
                             log_path=args.logs / f"pdserve-{disaggregation}.log") as process:
        await asyncio.sleep(1.0)  # every worker up
        yield f"http://127.0.0.1:{port}", with_descendants(psutil.Process(process.pid))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="16,128,256", help="stream counts, comma-separated")
    parser.add_argument("--workers", type=int, default=2, help="nginx's worker processes and pdserve's")
    parser.add_argument("--rounds", type=int, default=2, help="windows per path and stream count")
    parser.add_argument("--duration", type=float, default=10.0, help="steady seconds per path and stream count")
    parser.add_argument("--load-processes", type=int, default=1, help="load generator processes")
    parser.add_argument("--upstreams", type=int, default=1, help="synthetic engine processes")
    parser.add_argument("--output-tokens", type=int, default=256, help="tokens per reply: fewer weighs each request's own cost more per chunk")
    parser.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx",
                        help="the nginx binary (default: on PATH, else /usr/sbin/nginx)")
    parser.add_argument("--logs", type=Path, default=Path(".pdserve/proxy-reference"))
    arguments = parser.parse_args()
    if not os.access(arguments.nginx, os.X_OK):  # before any engine starts, not as a traceback from inside a window
        parser.exit(2, f"error: no nginx at {arguments.nginx}: install Debian's (apt-get install nginx-light) "
                       "or pass --nginx PATH\n")
    asyncio.run(main(arguments))
