"""No false alarm from the KV integrity check (issue 57; pdserve_vllm/kv_integrity.py): clean PD requests, greedy and
sampled, chat and completions, several in flight, through a real `pdserve up` of one demo model on this machine's CPU,
optionally with a CPU hog beside them. Writes the raw counts to docs/results/kv-integrity-clean/<model>-<n>.json.

    .venv/bin/python bench/kv_integrity_clean.py --model demo --requests 1000 --hog
    .venv/bin/python bench/kv_integrity_clean.py --model hybrid --requests 1000 --hog

Engine and gateway logs stay in the folder it prints. A false alarm is a clean handoff the decode engine calls a mismatch (its log's ``KV INTEGRITY MISMATCH``) or the
gateway counts other than ``ok`` (``pdserve_kv_integrity_total``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.demo.random_weights import write_random_weights
from pdserve.demo.shapes import Shape, write_shape_model
from pdserve.engine_config import DEMO_MODEL_NAME
from tests.e2e.conftest import Stack, start_stack, stop_stack
from tests.e2e.test_kv_integrity import MISMATCH_LINE, WORDS

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "kv-integrity-clean"
HOG = "while True: pass"


def start(model: str, workdir: Path) -> tuple[Stack, str]:
    if model == "demo":
        return start_stack(workdir, sections={}), DEMO_MODEL_NAME
    model_dir = write_shape_model(workdir / "model", Shape.QWEN3_NEXT_TINY)
    write_random_weights(model_dir)
    sections = {"model": {"path": str(model_dir), "served_name": "tiny-hybrid", "max_model_len": 1024}}
    return start_stack(workdir, sections=sections), "tiny-hybrid"


def body_of(model: str, index: int, *, hybrid: bool) -> tuple[str, dict[str, Any], str]:
    """Request ``index``'s path, body and kind (api/sampling), cycling over the four kinds."""
    generator = random.Random(index)
    count = generator.randrange(5, 300)
    prompt = (" ".join(f"t{generator.randrange(1, 4090)}" for _ in range(count)) if hybrid
              else f"Note {index}: " + " ".join(generator.choice(WORDS) for _ in range(count)))
    sampled = index % 2 == 1
    common = {"model": model, "max_tokens": generator.randrange(2, 24), "stream": True,
              "stream_options": {"include_usage": True}, "temperature": 0.8 if sampled else 0.0}
    sampling = "sampled" if sampled else "greedy"
    if index // 2 % 2:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}, f"chat/{sampling}"
    return "/v1/completions", {**common, "prompt": prompt}, f"completions/{sampling}"


async def send(client: httpx.AsyncClient, base_url: str, path: str, body: dict[str, Any]) -> str:
    """How the request ended: ``200``, ``error_event`` or the HTTP status."""
    async with client.stream("POST", base_url + path, json=body, headers={"X-PD-Mode": "pd"}) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return str(reply.status_code)
        error = False
        async for line in reply.aiter_lines():
            error = error or (line.startswith("data: {") and '"error"' in line[:20])
        return "error_event" if error else "200"


def integrity(base_url: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in httpx.get(base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("pdserve_kv_integrity_total{"):
            found[line.split("{", 1)[1].split("}", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return found


async def run(stack: Stack, model: str, *, requests: int, in_flight: int, hybrid: bool) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    gate = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(index: int) -> None:
            path, body, kind = body_of(model, index, hybrid=hybrid)
            async with gate:
                outcomes[f"{kind} {await send(client, stack.base_url, path, body)}"] += 1
        await asyncio.gather(*(one(index) for index in range(requests)))
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("demo", "hybrid"), default="demo")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--hog", action="store_true", help="one process spinning a core beside the engines")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kv-integrity-clean-"))
    print(f"logs in {workdir}", flush=True)
    stack, model = start(args.model, workdir)
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if args.hog else None
    try:
        before, started = integrity(stack.base_url), time.monotonic()
        outcomes = asyncio.run(run(stack, model, requests=args.requests, in_flight=args.in_flight,
                                   hybrid=args.model == "hybrid"))
        elapsed_s, after = time.monotonic() - started, integrity(stack.base_url)
        alarms = sum(path.read_text(errors="replace").count(MISMATCH_LINE) for path in (workdir / "logs").glob("*.log"))
        (workdir / "gateway.log").write_text("".join(stack.output))
    finally:
        if hog is not None:
            hog.kill()
        stop_stack(stack)
    result = {"model": args.model, "requests": args.requests, "in_flight": args.in_flight, "hog": args.hog,
              "elapsed_s": round(elapsed_s, 1), "outcomes": dict(sorted(outcomes.items())),
              "engine_mismatches": alarms,
              "gateway_kv_integrity_total": {key: value - before.get(key, 0.0) for key, value in after.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.model}-{args.requests}{'-hog' if args.hog else ''}.json").write_text(
        json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
