"""Routing by prefix and load against load alone, on the CPU demo with 1 prefill and 2 decode engines
and a multi-turn chat workload (issue "Many engines"): conversations of 4 turns, a 256-token system
prompt all share, 320 new prompt tokens and 32 output tokens a turn, so a conversation's own history
is most of each later turn's prompt.

    .venv/bin/python bench/prefix_routing.py [--arm NAME=JSON ...] [--rounds 2] [--rate 2] [--duration 40] [--out DIR]

Each arm runs on `pdserve up` started afresh with ``routing.disaggregation: auto`` and the arm's JSON
as more of its routing section. By default two arms: "prefix", the gateway's routing as configured
by default; "load-only", which weighs no cached prefix (``routing.cached_tokens_per_request``
1e12), so only load tells engines apart (and, among equal ones, each prompt's home). Per run: `pdserve
bench run --workload chat` through the gateway, and the decode engines' own prefix-cache counters
before and after it. Prints per run TTFT p50/p90, the decode engines' prefix hit rate over the run
and the gateway's decisions; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.config_ab import add_run_options, parse_arm, run_rounds
from bench.soak import ENGINE_KEY, Deployment, start
from pdserve.routing.load import parse_engine_load

# The routing section of each arm; --arm NAME=JSON replaces these.
ARMS: dict[str, dict[str, Any]] = {"prefix": {}, "load-only": {"cached_tokens_per_request": 1e12}}


def prefix_tokens(urls: list[str]) -> tuple[float, float]:
    """(queried, hit) prompt tokens the engines at ``urls`` have looked up in their prefix caches."""
    loads = [parse_engine_load(httpx.get(url + "/metrics", headers=ENGINE_KEY.headers(), timeout=10).text,
                                read_s=0.0) for url in urls]
    return sum(load.prefix_queried_tokens for load in loads), sum(load.prefix_hit_tokens for load in loads)


def decisions(base_url: str) -> dict[str, float]:
    lines = httpx.get(base_url + "/metrics", timeout=10).text.splitlines()
    return {line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line.startswith("pdserve_disaggregation_decisions_total{")}


def run_once(name: str, routing: dict[str, Any], workdir: Path, *, rate: str, duration: float,
             out: Path) -> dict[str, Any]:
    # One gateway process: each keeps its own prefix index, and a client's turns may reach different ones.
    deployment: Deployment = start(workdir, sections={"routing": {"disaggregation": "auto", **routing},
                                                      "gateway": {"workers": 1}})
    decode_urls = deployment.engine_urls[1:]
    try:
        queried_before, hit_before = prefix_tokens(decode_urls)
        subprocess.run([sys.executable, "-m", "pdserve", "bench", "run", "-t", f"{name}={deployment.base_url}",
                        "--workload", "chat", "--turns", "4", "--prefix-tokens", "256", "--input-tokens", "320",
                        "--output-tokens", "32", "--rate", rate, "--duration", str(duration), "--out", str(out)],
                       check=True, capture_output=True, text=True)
        queried, hit = prefix_tokens(decode_urls)
        chosen = decisions(deployment.base_url)
    finally:
        deployment.stop()
    point = json.loads((out / "results.json").read_text())["results"][0]
    return {"ttft_ms": point["ttft_ms"], "itl_ms": point["itl_ms"], "requests": point["requests"],
            "errors": point["errors"], "decode_prefix_hit_rate": round((hit - hit_before) / (queried - queried_before), 3),
            "decisions": chosen, "load_average": round(os.getloadavg()[0], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", type=parse_arm, action="append", help="NAME=JSON routing section (default: "
                        "prefix={} and load-only={\"cached_tokens_per_request\": 1e12})")
    add_run_options(parser, rate="2", duration=40.0, out="runs/prefix-routing")
    args = parser.parse_args()
    runs = run_rounds(
        dict(args.arm or ARMS.items()), rounds=args.rounds, temp_prefix="pdserve-prefix-routing-",
        run=lambda name, routing, workdir, round_number: run_once(
            name, routing, workdir, rate=args.rate, duration=args.duration, out=args.out / f"round{round_number}-{name}"),
        describe=lambda run: (f"TTFT p50 {run['ttft_ms']['p50']:.1f} p90 {run['ttft_ms']['p90']:.1f} ms, decode prefix "
                              f"hit rate {run['decode_prefix_hit_rate']:.1%}, {run['requests']} requests "
                              f"{run['errors']} errors, decisions {run['decisions']}, load average {run['load_average']}"))
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
