"""What a slower link between the prefill and the decode host costs: per link rate, the KV GB/s the
decode engine measured (`pdserve verify`), the KV handoff (the gateway's record: prefill done to the
first decoded token) and the client's TTFT, on the bed of hosts (tests/netbed.py, as root).

    sudo .venv/bin/python bench/netbed_links.py --output docs/results/netbed-links [--rates 0,10000,1000]

Rate 0 is the veth link unshaped; others are a tbf on both ends of the prefill host's link, in Mbit/s.
Writes raw.json (every request and verify report) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.machine import machine_state
from pdserve.engine_config import DEMO_MODEL_NAME
from tests import netbed
from tests.netbed_pd import Deployment, deployed, recent

PROMPT = "The module provides functions for reading and writing files, sockets and other streams. " * 12


def streamed(deployment: Deployment, *, mode: str, request_id: str) -> dict[str, Any]:
    """One streamed request; its client TTFT and the gateway's record of it."""
    body = {"model": DEMO_MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    started_s = time.perf_counter()
    ttft_s = None
    with httpx.stream("POST", deployment.gateway_url + "/v1/completions", json=body, timeout=300,
                      headers={"X-PD-Mode": mode, "X-Request-Id": request_id}) as reply:
        for line in reply.iter_lines():
            if ttft_s is None and line.startswith("data: {"):
                ttft_s = time.perf_counter() - started_s
    return {"mode": mode, "client_ttft_s": ttft_s, **recent(deployment, request_id)}


def verify(deployment: Deployment) -> dict[str, Any]:
    decode = deployment.bed.hosts["decode"]
    config = deployment.logs["decode"].with_name("decode.yaml")
    out = subprocess.run(decode.argv(sys.executable, "-m", "pdserve", "verify", "--config", str(config), "--json",
                                     "--gateway-url", deployment.gateway_url, "--probes", "2"), check=False, capture_output=True, text=True, timeout=900)
    reports: list[dict[str, Any]] = json.loads(out.stdout or "[]")
    return reports[0] if reports else {"error": out.stderr[-2000:]}


def measure(deployment: Deployment, rate_mbit: int, *, requests: int) -> dict[str, Any]:
    if rate_mbit:
        deployment.bed.rate_limit("prefill", rate_mbit=rate_mbit)
    try:
        runs = [streamed(deployment, mode=mode, request_id=f"rate{rate_mbit}-{mode}-{index}")
                for index in range(requests) for mode in ("pd", "local")]
        report = verify(deployment)
    finally:
        deployment.bed.clear_limits("prefill")
    return {"rate_mbit": rate_mbit, "requests": runs, "verify": report}


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| link | KV GB/s (engine) | handoff ms (median) | PD TTFT ms | local TTFT ms | verify |",
             "|---|---|---|---|---|---|"]
    for result in results:
        pd = [run for run in result["requests"] if run["mode"] == "pd"]
        local = [run for run in result["requests"] if run["mode"] == "local"]
        handoffs = [run["handoff_s"] for run in pd if run["handoff_s"] is not None]
        verdict = result["verify"].get("verdict", {})
        lines.append("| {} | {:.3f} | {} | {:.0f} | {:.0f} | {} |".format(
            f"{result['rate_mbit']} Mbit/s" if result["rate_mbit"] else "veth, unshaped",
            verdict.get("measured_gbps", float("nan")),
            f"{statistics.median(handoffs) * 1000:.0f}" if handoffs else "-",
            statistics.median(run["client_ttft_s"] for run in pd) * 1000,
            statistics.median(run["client_ttft_s"] for run in local) * 1000,
            "OK" if result["verify"].get("ok") else "FAIL"))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--rates", default="0,10000,1000", help="Mbit/s per run; 0 = unshaped")
    parser.add_argument("--requests", type=int, default=3, help="streamed requests per mode and rate")
    args = parser.parse_args()
    if (reason := netbed.why_not()) is not None:
        print(f"no network bed here: {reason}", file=sys.stderr)
        return 2
    args.output.mkdir(parents=True, exist_ok=True)
    started = machine_state()
    with deployed(args.output, tag="bench") as deployment:
        results = [measure(deployment, int(rate), requests=args.requests) for rate in args.rates.split(",")]
    raw = {"machine": {"start": started, "end": machine_state()}, "command": sys.argv, "links": results}
    (args.output / "raw.json").write_text(json.dumps(raw, indent=2))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
