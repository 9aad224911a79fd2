"""A soak with faults: `pdserve up` on the CPU demo (1 prefill, 2 decode engines), a steady load of
requests, and faults injected while it runs (docs/reliability.md, "Soak").

    .venv/bin/python bench/soak.py [--requests 1000] [--concurrency 12] [--out docs/results/soak-cpu]

Faults, at fixed shares of the requests sent: kill -9 of the prefill engine, kill -9 of a decode
engine, SIGSTOP of the other decode engine for 10 s, and a burst of 80 requests at once past the
gateway's bounds. Among the steady requests: clients that disconnect mid-stream and malformed
bodies. Every request must end in success or an explicit error (an HTTP error, or an SSE error
event then [DONE]); a hang (no answer in 120 s) or a cut stream is a lost request. After the
run, every engine's KV cache usage must be back at zero: read 3 s after the last request, then again
until NIXL's lease (30 s) has run out, since a handoff whose decode engine died is freed by it.
Prints a markdown table and, last, JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve.engine_key import GENERATED_KEY_BYTES, EngineKey
from pdserve_vllm import ENGINE_KEY_ENV
from tests.conftest import free_port_block

CLIENT_TIMEOUT_S = 120.0
KV_LEASE_S = 30.0  # NIXL's kv_lease_duration: a prefill engine frees an unpulled handoff after it
PROMPT_WORDS = ("the", "module", "provides", "functions", "for", "reading", "and", "writing", "files", "sockets",
                "and", "other", "streams")
GATEWAY = {"workers": 1, "health_interval_s": 0.5, "prefill_timeout_s": 15, "first_token_timeout_s": 30,
           "decode_idle_timeout_s": 4, "max_in_flight": 40, "max_queued": 8, "queue_timeout_s": 5,
           "eject_for_s": 2}


@dataclass
class Outcome:
    kind: str  # ok, error (explicit: status or SSE error event), rejected (429), disconnected, lost
    status: int
    started_s: float
    ended_s: float
    retry_after_s: str = ""
    detail: str = ""


@dataclass
class Deployment:
    base_url: str
    engine_urls: list[str]  # prefill, decode 0, decode 1
    process: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)

    def stop(self) -> None:
        """Ctrl-C to `pdserve up`, and wait until it has stopped every engine."""
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=120)


# The engines' key, given to the deployments these scripts start, so that they can read the engines' /metrics
# (every engine pdserve launches requires it: pdserve/engine_key.py).
ENGINE_KEY = EngineKey(secrets.token_urlsafe(GENERATED_KEY_BYTES))
KEYED_ENV = {**os.environ, ENGINE_KEY_ENV: ENGINE_KEY.value}


def start(workdir: Path, *, sections: dict[str, dict[str, object]] | None = None) -> Deployment:
    """`pdserve up` with 1 prefill and 2 decode engines on free ports, ``sections`` laid over that."""
    base = free_port_block(7)
    config: dict[str, dict[str, object]] = {
        "prefill": {"base_port": base + 1}, "decode": {"engines": 2, "base_port": base + 2},
        "kv": {"side_channel_base_port": base + 4}, "gateway": {"port": base},
        "launch": {"log_dir": str(workdir / "logs"), "restart_backoff_s": 0.5}}
    for name, section in (sections or {}).items():
        config[name] = {**config.get(name, {}), **section}
    (workdir / "soak.yaml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--config", str(workdir / "soak.yaml")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=workdir, env=KEYED_ENV)
    deployment = Deployment(f"http://127.0.0.1:{base}", [f"http://127.0.0.1:{base + i}" for i in (1, 2, 3)], process)
    assert process.stdout is not None
    for line in process.stdout:
        deployment.log.append(line)
        print(line, end="", file=sys.stderr, flush=True)
        if line.startswith("ready in"):
            threading.Thread(target=lambda: deployment.log.extend(process.stdout or []), daemon=True).start()
            return deployment
    raise SystemExit("pdserve up ended before it was ready:\n" + "".join(deployment.log[-40:]))


def engine_pid(url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    for connection in psutil.net_connections("tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port and connection.pid:
            return int(connection.pid)
    raise RuntimeError(f"nothing listens on {url}")


def body_for(index: int, rng: random.Random) -> tuple[str, bytes, int | None]:
    """(path, body, disconnect after N chunks) for the index-th steady request."""
    prompt = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(20, 200)))
    share = index % 20
    if share == 0:  # malformed: not JSON, or a field of the wrong type
        return "/v1/completions", rng.choice([b'{"model": ', b'{"model": "%s", "prompt": 5}' % DEMO_MODEL_NAME.encode()]), None
    if share in (1, 2):  # chat, whole reply
        body = {"model": DEMO_MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24}
        return "/v1/chat/completions", json.dumps(body).encode(), None
    body = {"model": DEMO_MODEL_NAME, "prompt": prompt, "max_tokens": rng.randint(16, 64), "stream": True,
            "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True}
    return "/v1/completions", json.dumps(body).encode(), (rng.randint(1, 8) if share in (3, 4) else None)


async def send(session: aiohttp.ClientSession, base: str, path: str, body: bytes, disconnect_after: int | None) -> Outcome:
    started = time.monotonic()
    try:
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            async with session.post(base + path, data=body, headers={"Content-Type": "application/json"}) as reply:
                if reply.status == 429:
                    await reply.read()
                    return Outcome("rejected", 429, started, time.monotonic(), reply.headers.get("Retry-After", ""))
                if reply.status != 200:
                    error = (await reply.json())["error"]  # an OpenAI error body, or this raises
                    return Outcome("error", reply.status, started, time.monotonic(), detail=str(error.get("code")))
                if reply.content_type != "text/event-stream":
                    await reply.json()
                    return Outcome("ok", 200, started, time.monotonic())
                text, chunks = b"", 0
                async for chunk in reply.content.iter_any():
                    text, chunks = text + chunk, chunks + 1
                    if disconnect_after is not None and chunks >= disconnect_after:
                        return Outcome("disconnected", 200, started, time.monotonic())
    except TimeoutError:
        return Outcome("lost", 0, started, time.monotonic(), detail="no answer in time")
    except (aiohttp.ClientError, ValueError, KeyError) as exc:
        return Outcome("lost", 0, started, time.monotonic(), detail=repr(exc)[:200])
    if not text.endswith(b"data: [DONE]\n\n"):
        return Outcome("lost", 200, started, time.monotonic(), detail="stream cut without [DONE]")
    kind = "error" if b'data: {"error"' in text else "ok"
    return Outcome(kind, 200, started, time.monotonic(), detail="sse error event" if kind == "error" else "")


class Faults:
    """Injects each fault once its share of requests has been sent; records when each was active."""

    def __init__(self, deployment: Deployment, total: int) -> None:
        self._deployment, self._total = deployment, total
        self._plan = [(0.15, "kill -9 prefill"), (0.35, "kill -9 decode-0"), (0.55, "SIGSTOP decode-1 10 s"),
                      (0.75, "burst of 80")]
        self.windows: list[tuple[str, float, float]] = []  # (fault, from, to: engine healthy again)
        self.tasks: list[asyncio.Task[None]] = []

    def due(self, sent: int) -> str | None:
        if self._plan and sent >= self._plan[0][0] * self._total:
            return self._plan.pop(0)[1]
        return None

    async def inject(self, name: str, session: aiohttp.ClientSession, burst: list[asyncio.Task[Outcome]]) -> None:
        prefill, decode_0, decode_1 = self._deployment.engine_urls
        started = time.monotonic()
        if name.startswith("kill"):
            url = prefill if "prefill" in name else decode_0
            old_pid = engine_pid(url)
            os.kill(old_pid, signal.SIGKILL)
            await until_healthy(session, url, not_pid=old_pid)
        elif name.startswith("SIGSTOP"):
            pid = engine_pid(decode_1)
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(10)
            os.kill(pid, signal.SIGCONT)
            await until_healthy(session, decode_1)
        else:
            rng = random.Random(99)
            burst += [asyncio.create_task(send(session, self._deployment.base_url, *body_for(5 + i, rng)))
                      for i in range(80)]
            await asyncio.gather(*burst)
        self.windows.append((name, started, time.monotonic()))
        print(f"fault {name}: {time.monotonic() - started:.1f} s until recovered", file=sys.stderr, flush=True)


async def until_healthy(session: aiohttp.ClientSession, url: str, *, not_pid: int | None = None) -> None:
    while True:
        await asyncio.sleep(1)
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as reply:
                if reply.status == 200 and engine_pid(url) != not_pid:
                    return
        except (aiohttp.ClientError, TimeoutError, RuntimeError):
            pass


async def kv_usage(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics", headers=ENGINE_KEY.headers()) as reply:
        text = await reply.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc{"))


async def soak(deployment: Deployment, *, requests: int, concurrency: int) -> dict[str, object]:
    rng, faults = random.Random(7), Faults(deployment, requests)
    outcomes: list[Outcome] = []
    burst: list[asyncio.Task[Outcome]] = []
    slots = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def one(index: int) -> None:
            async with slots:
                outcomes.append(await send(session, deployment.base_url, *body_for(index, rng)))
        steady = []
        for index in range(requests):
            await slots.acquire()
            slots.release()
            if (fault := faults.due(index)) is not None:
                faults.tasks.append(asyncio.create_task(faults.inject(fault, session, burst)))
            steady.append(asyncio.create_task(one(index)))
            await asyncio.sleep(0)
        await asyncio.gather(*steady, *faults.tasks)
        outcomes += [task.result() for task in burst]
        await asyncio.sleep(3)  # aborted streams reach their engines
        kv_after = {url: await kv_usage(session, url) for url in deployment.engine_urls}
        kv_idle_after_s = await seconds_until_kv_idle(session, deployment.engine_urls, within_s=KV_LEASE_S + 5)
        async with session.get(deployment.base_url + "/metrics") as reply:
            gateway_metrics = [line for line in (await reply.text()).splitlines()
                               if line.startswith(("pdserve_local_fallbacks_total", "pdserve_decode_switches_total",
                                                   "pdserve_engine_ejections_total", "pdserve_kv_releases_total",
                                                   "pdserve_requests_rejected_total", "pdserve_leg_failures_total"))]
    return report(outcomes, faults.windows, kv_after, kv_idle_after_s, gateway_metrics)


async def seconds_until_kv_idle(session: aiohttp.ClientSession, urls: list[str], *, within_s: float) -> float | None:
    """Seconds until every engine at ``urls`` holds no KV block (read each half second); None if
    some still hold blocks after ``within_s``: leaked, since the lease would have freed them."""
    started_s = time.monotonic()
    while time.monotonic() - started_s <= within_s:
        if not any([await kv_usage(session, url) for url in urls]):
            return round(time.monotonic() - started_s, 1)
        await asyncio.sleep(0.5)
    return None


def report(outcomes: list[Outcome], windows: list[tuple[str, float, float]], kv_after: dict[str, float],
           kv_idle_after_s: float | None, gateway_metrics: list[str]) -> dict[str, object]:
    during = [o for o in outcomes if any(o.started_s < end and o.ended_s > begin for _, begin, end in windows[:3])]
    engine_fault_requests = [o for o in during if o.kind in ("ok", "error")]
    return {
        "requests": len(outcomes), "kinds": dict(Counter(o.kind for o in outcomes)),
        "statuses": dict(Counter(str(o.status) for o in outcomes)),
        "lost": [asdict(o) for o in outcomes if o.kind == "lost"],
        "engine_fault_window_requests": len(engine_fault_requests),
        "succeeded_despite_engine_fault": sum(o.kind == "ok" for o in engine_fault_requests),
        "retry_after_s": dict(Counter(o.retry_after_s for o in outcomes if o.kind == "rejected")),
        "errors": dict(Counter(f"{o.status} {o.detail}" for o in outcomes if o.kind == "error")),
        "faults": [{"fault": name, "recovered_s": round(end - begin, 1)} for name, begin, end in windows],
        "kv_usage_after": kv_after, "kv_idle_after_s": kv_idle_after_s, "gateway_metrics": gateway_metrics,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "load_average": os.getloadavg()},
    }


def to_markdown(result: dict[str, object]) -> str:
    kinds = result["kinds"]
    assert isinstance(kinds, dict)
    rows = [f"| {kind} | {count} |" for kind, count in sorted(kinds.items())]
    return "\n".join(["| outcome | requests |", "|---|---|", *rows, "",
                      (f"during engine faults: {result['succeeded_despite_engine_fault']} of "
                       f"{result['engine_fault_window_requests']} answered requests succeeded"),
                      f"429 Retry-After values: {result['retry_after_s']}",
                      f"KV usage 3 s after the last request: {result['kv_usage_after']}",
                      f"every engine's KV cache empty {result['kv_idle_after_s']} s later (None: blocks leaked)"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as workdir:
        deployment = start(Path(workdir), sections={"gateway": GATEWAY})
        try:
            result = asyncio.run(soak(deployment, requests=args.requests, concurrency=args.concurrency))
        finally:
            deployment.stop()
    markdown = to_markdown(result)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=2))
        (args.out / "results.md").write_text(markdown + "\n")
        (args.out / "gateway.log").write_text("".join(line for line in deployment.log
                                                      if "WARNING" in line or "ERROR" in line))
    print(markdown)
    print(json.dumps(result))
    sys.exit(1 if result["lost"] or result["kv_idle_after_s"] is None else 0)


if __name__ == "__main__":
    main()
