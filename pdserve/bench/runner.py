"""The load generator: send requests open-loop (at fixed arrival times) or closed-loop (N streams)
to a target's URLs, and record per-request timestamps. No statistics here (stats.py does them).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from pdserve.bench.records import RequestRecord
from pdserve.bench.sse import StreamReading
from pdserve.bench.workload import BenchRequest
from pdserve.config import secret_env
from pdserve.errors import ConfigError

CLIENT_KEY_ENV = "OPENAI_API_KEY"  # the key OpenAI's own clients send; the load sends it to a gateway with keys
OnDone = Callable[[RequestRecord], None]


@dataclass(frozen=True, slots=True)
class Target:
    """A named endpoint under test; several URLs share its requests round-robin."""

    name: str
    urls: tuple[str, ...]  # base URLs, without /v1
    headers: tuple[tuple[str, str], ...] = ()  # over client_headers(): the engine key's, for pdserve's engines

    @classmethod
    def parse(cls, text: str, *, headers: Mapping[str, str] | None = None) -> Target:
        """``name=URL[,URL...]``, sent ``headers`` too; raises ConfigError when the name or a URL is missing."""
        name, _, urls = text.partition("=")
        base_urls = tuple(url.strip().rstrip("/").removesuffix("/v1") for url in urls.split(",") if url.strip())
        if not name or not base_urls or not all(url.startswith(("http://", "https://")) for url in base_urls):
            raise ConfigError(f"--target: expected NAME=http://HOST:PORT[,http://...], not {text!r}")
        return cls(name, base_urls, tuple((headers or {}).items()))


def client_headers() -> dict[str, str]:
    """What every load request carries: JSON, and ``Authorization`` where CLIENT_KEY_ENV holds an API key."""
    key = secret_env(CLIENT_KEY_ENV)
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def new_session() -> aiohttp.ClientSession:
    """Unlimited pooled keep-alive connections, like a fleet of clients that stay connected."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0),
                                 auto_decompress=False, headers=client_headers())


async def run_open_loop(
    session: aiohttp.ClientSession, target: Target, requests: Sequence[BenchRequest], arrivals_s: Sequence[float],
    *, timeout_s: float, on_done: OnDone,
) -> list[RequestRecord]:
    """Send ``requests[i]`` at ``arrivals_s[i]`` seconds from now, whatever is still in flight."""
    urls = itertools.cycle(target.urls)
    start_s = time.perf_counter()
    tasks = []
    for request, arrival_s in zip(requests, arrivals_s, strict=True):
        delay_s = start_s + arrival_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.ensure_future(
            _send_and_report(session, target, next(urls), request, timeout_s=timeout_s, on_done=on_done)
        ))
    return list(await asyncio.gather(*tasks))


async def run_closed_loop(
    session: aiohttp.ClientSession, target: Target, requests: Iterator[BenchRequest], *, streams: int,
    duration_s: float, stagger_s: float, timeout_s: float, on_done: OnDone,
) -> list[RequestRecord]:
    """Keep ``streams`` requests in flight for ``duration_s``; each stream starts its next request
    when the previous one ends. Stream i starts ``i * stagger_s / streams`` late, so arrivals
    spread out instead of arriving in lockstep waves. In-flight requests finish after the end.
    """
    urls = itertools.cycle(target.urls)
    stop_s = time.perf_counter() + duration_s
    records: list[RequestRecord] = []

    async def stream(index: int) -> None:
        await asyncio.sleep(index * stagger_s / streams)
        while time.perf_counter() < stop_s:
            records.append(await _send_and_report(
                session, target, next(urls), next(requests), timeout_s=timeout_s, on_done=on_done
            ))

    async with asyncio.TaskGroup() as group:
        for index in range(streams):
            group.create_task(stream(index))
    return records


async def _send_and_report(
    session: aiohttp.ClientSession, target: Target, url: str, request: BenchRequest, *, timeout_s: float,
    on_done: OnDone,
) -> RequestRecord:
    record = await send(session, target.name, url, request, timeout_s=timeout_s, headers=target.headers)
    on_done(record)
    return record


async def send(
    session: aiohttp.ClientSession, target: str, url: str, request: BenchRequest, *, timeout_s: float,
    headers: Sequence[tuple[str, str]] = (),
) -> RequestRecord:
    """One streamed request, with ``headers`` over the session's (client_headers); every failure (status, broken
    stream, timeout) becomes ``error``."""
    payload = json.dumps(request.body).encode()
    stream = StreamReading()
    sent_s = time.perf_counter()
    try:
        async with session.post(url + request.path, data=payload, headers=dict(headers) if headers else None,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                stream.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            else:
                async for chunk in response.content.iter_any():
                    stream.feed(chunk, now_s=time.perf_counter())
    except (aiohttp.ClientError, TimeoutError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    return RequestRecord(
        target=target, url=url, sent_s=sent_s, token_times_s=tuple(stream.token_times_s), done_s=time.perf_counter(),
        output_tokens=stream.usage_tokens or len(stream.token_times_s), error=stream.outcome(),
    )
