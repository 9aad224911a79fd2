"""How long a prefill engine holds a handoff nobody takes: given back by pdserve (``release_kv``)
against left to NIXL's lease (docs/reliability.md, "Cancellation").

    .venv/bin/python bench/kv_release.py --prefill-url http://127.0.0.1:8100 --decode-url http://127.0.0.1:8200

Against a running, idle `pdserve up` (the CPU demo), with its engine key (PDSERVE_ENGINE_KEY, else the one it keeps in
its run folder): each case prefills one prompt for a remote decode engine and times until the prefill engine's
``vllm:kv_cache_usage_perc`` reads zero again.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.config import load_settings
from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve.engine_key import engine_session, load_engine_key
from pdserve.pd import decode, prefill
from pdserve.pd.engine_http import EngineClient

PROMPT = "word " * 300


async def kv_usage(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as reply:
        text = await reply.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc{"))


async def seconds_held(session: aiohttp.ClientSession, client: EngineClient, args: argparse.Namespace, *,
                       give_back: bool) -> float:
    body = prefill.make_body({"model": DEMO_MODEL_NAME, "prompt": PROMPT}, connector="NixlConnector")
    kv = await prefill.run(client, args.prefill_url + "/v1/completions", body, request_id=f"held-{time.time_ns()}",
                           timeout_s=60)
    assert await kv_usage(session, args.prefill_url) > 0, "the prefill engine should hold the handoff"
    started = time.monotonic()
    if give_back:
        await decode.release_kv(client, args.decode_url, kv, request_id="kv-release-bench", timeout_s=10)
    while await kv_usage(session, args.prefill_url) > 0:
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def main(args: argparse.Namespace) -> None:
    settings = load_settings()
    engine_key = load_engine_key(settings.gateway, run_dir=settings.run_dir)
    client = EngineClient(connect_timeout_s=5, headers=engine_key.headers())
    async with engine_session(engine_key) as session:
        for give_back in (True, False):
            held_s = await seconds_held(session, client, args, give_back=give_back)
            print(f"{'given back by pdserve' if give_back else 'left to the lease':24} freed after {held_s:.2f} s")
    client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-url", default="http://127.0.0.1:8100")
    parser.add_argument("--decode-url", default="http://127.0.0.1:8200")
    asyncio.run(main(parser.parse_args()))
