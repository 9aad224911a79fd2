"""Child processes a benchmark stands up (synthetic upstream, gateway): start one, wait until it
answers, stop it. A separate process per part is what keeps a 2-core measurement honest.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Collection, Sequence
from pathlib import Path

import aiohttp

from pdserve.errors import BenchFailed

_POLL_S = 0.1


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it; it stays free unless raced)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def child_service(
    argv: Sequence[str], *, ready_url: str, log_path: Path, ready_timeout_s: float = 60.0,
    cores: Collection[int] = (),
) -> AsyncIterator[asyncio.subprocess.Process]:
    """Run ``argv`` for the block, once ``ready_url`` answers 200; its output goes to ``log_path``.
    With ``cores``, it and every process it starts run only on them.

    Raises BenchFailed, quoting the log, when it exits or is not ready in ``ready_timeout_s``.
    The process is terminated (then killed after 10 s) however the block ends.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True, preexec_fn=functools.partial(os.sched_setaffinity, 0, cores) if cores else None,
        )
        try:
            await _wait_ready(process, ready_url, timeout_s=ready_timeout_s, log_path=log_path)
            yield process
        finally:
            await _stop(process)


@contextlib.asynccontextmanager
async def synthetic_engines(
    count: int, *, log_dir: Path, flags: Sequence[str] = ()
) -> AsyncIterator[list[tuple[str, asyncio.subprocess.Process]]]:
    """``count`` synthetic engines (``pdserve bench upstream FLAGS``), each a process on a port of
    its own, for the block, once each answers; their base URLs and processes."""
    async with contextlib.AsyncExitStack() as stack:
        engines = []
        for index in range(count):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            argv = [sys.executable, "-m", "pdserve", "bench", "upstream", "--port", str(port), *flags]
            engines.append((url, await stack.enter_async_context(child_service(
                argv, ready_url=f"{url}/health", log_path=log_dir / f"upstream-{index}.log"))))
        yield engines


# For a benchmark's gateways (``env`` before ``pdserve serve``). gateway.max_in_flight_per_engine (256)
# mirrors vLLM's batch limit; the synthetic engines have none, and with it a gateway process would queue
# every leg past 256 on one engine: a point would measure that queue (seconds of TTFT), not the relay.
BENCH_GATEWAY_ENV = ("PDSERVE_GATEWAY__MAX_IN_FLIGHT_PER_ENGINE=1000000",)


def gateway_argv(engine_urls: Sequence[str], *, port: int, env: Sequence[str] = (), python_flags: Sequence[str] = (),
                 flags: Sequence[str] = ()) -> list[str]:
    """``pdserve serve`` on ``port`` as a benchmark runs it: each of ``engine_urls`` both a prefill and a
    decode engine, with BENCH_GATEWAY_ENV and ``env`` (``NAME=value``) set. Pure."""
    engines = [flag for url in engine_urls for flag in ("--prefill-url", url, "--decode-url", url)]
    return ["env", *BENCH_GATEWAY_ENV, *env, sys.executable, *python_flags, "-m", "pdserve", "serve", *engines,
            "--port", str(port), *flags]


async def _wait_ready(process: asyncio.subprocess.Process, url: str, *, timeout_s: float, log_path: Path) -> None:
    deadline_s = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline_s:
            if process.returncode is not None:
                raise BenchFailed(f"{log_path.stem} exited with {process.returncode}:\n{_tail(log_path)}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as reply:
                    if reply.status == 200:
                        return
            await asyncio.sleep(_POLL_S)
    raise BenchFailed(f"{log_path.stem} not ready at {url} after {timeout_s:.0f} s:\n{_tail(log_path)}")


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), timeout=10.0)
    except TimeoutError:
        process.kill()
        await process.wait()


def _tail(log_path: Path, *, lines: int = 15) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
