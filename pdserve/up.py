"""``pdserve up``: the whole deployment on this machine (engines + gateway) until a signal.

Order: ports free -> vLLM versions in range (engines/vllm_version.py) -> model ready -> engines ready -> gateway up
-> the gateway's warm-up request through both legs (NIXL handshake done before any user request) -> the gateway's
address recorded in the run folder (gateway_address.py) -> ready line -> supervise -> stop all.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp

from pdserve.config import Settings
from pdserve.demo.model import build_demo_model
from pdserve.engine_key import NO_ENGINE_KEY, deployment_engine_key, engine_session, given_engine_key
from pdserve.engines.host_checks import gpu_memory_bytes
from pdserve.engines.launcher import busy_ports
from pdserve.engines.model_layout import ModelLayout, describe, read_layout
from pdserve.engines.supervisor import Supervisor
from pdserve.engines.vllm_version import check_engine_versions
from pdserve.errors import ConfigError, EngineStartFailed
from pdserve.gateway.server import GatewayServer, make_gateway_server
from pdserve.gateway_address import configured_url, forget_gateway, record_gateway

READY_POLL_S = 0.1


async def run_up(settings: Settings, *, progress: Callable[[str], None]) -> None:
    """Serve until SIGINT/SIGTERM or an engine dies for good; always stops every engine."""
    started_s = time.monotonic()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    _check_ports_free(settings)
    # engines at urls were given their key; those it launches get theirs below
    await check_engine_versions(settings, engine_key=given_engine_key(settings.gateway) or NO_ENGINE_KEY)
    model_path = await resolve_model(settings, progress=progress)
    layout = await resolve_layout(model_path, progress=progress)
    gpu_memory = await gpu_memory_bytes([settings.prefill, settings.decode])
    # The engines answer only the key, which the supervisor's polls and the gateway send: no other process may.
    with deployment_engine_key(settings.gateway, run_dir=settings.run_dir) as engine_key:
        supervisor = Supervisor(settings, model_path=model_path, layout=layout, progress=progress,
                                engine_key=engine_key, gpu_memory_bytes=gpu_memory)
        server = make_gateway_server(settings, members=supervisor.members, engine_key=engine_key)
        async with engine_session(engine_key) as session:
            await _serve(settings, supervisor, server, session, stop=stop, started_s=started_s, progress=progress)


async def _serve(settings: Settings, supervisor: Supervisor, server: GatewayServer, session: aiohttp.ClientSession,
                 *, stop: asyncio.Event, started_s: float, progress: Callable[[str], None]) -> None:
    """Engines, then the gateway, then supervise until ``stop``; ``session`` carries the engine key."""
    tasks: list[asyncio.Task[None]] = []
    try:
        progress(f"starting {len(supervisor.engines)} engine(s); Ctrl-C stops everything")
        if not await _until_stopped(stop, supervisor.start_all(session)):
            return
        tasks.append(asyncio.create_task(server.serve()))
        while not server.started:
            if tasks[0].done():  # uvicorn could not start: say why
                tasks[0].result()
                raise EngineStartFailed("the gateway server stopped during start-up")
            await asyncio.sleep(0.05)
        base_url = f"{settings.gateway.scheme}://{settings.gateway.host}:{settings.gateway.port}"
        # Not the engines' key: the gateway is no engine. Its readiness carries no secret either way, so its
        # certificate (gateway.ssl_certfile) need not name the address bound.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=False)) as gateway_session:
            ready = wait_ready(gateway_session, base_url, progress, timeout_s=settings.launch.ready_timeout_s)
            if not await _until_stopped(stop, ready):
                return
        record_gateway(settings.run_dir, url=configured_url(settings))  # `status`, `scale`, `verify` look here
        progress(ready_line(base_url, settings.model.served_name, time.monotonic() - started_s))
        tasks.append(asyncio.create_task(supervisor.keep_alive(session)))
        await _until_stopped(stop, _first_done(tasks))
    finally:
        progress("stopping gateway and engines ...")
        forget_gateway(settings.run_dir)
        server.should_exit = True
        await supervisor.stop_all()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        progress("stopped")


async def resolve_model(settings: Settings, *, progress: Callable[[str], None]) -> str:
    """The model folder engines load: the configured one, or the demo model (built on first use)."""
    if settings.model.path is not None:
        return settings.model.path
    return str(await asyncio.to_thread(build_demo_model, settings.demo_model_dir, progress=progress))


async def resolve_layout(model_path: str, *, progress: Callable[[str], None]) -> ModelLayout:
    """What the model at ``model_path`` needs of every engine, said to the user in one line.

    Raises ConfigError, before any engine starts, for a model no engine pair can hand off.
    """
    layout = await asyncio.to_thread(read_layout, model_path)
    progress(f"  {'model':<10} {describe(layout)}")
    return layout


def _check_ports_free(settings: Settings) -> None:
    """Fail before starting anything if a port we need is taken (a stale engine, say)."""
    if busy := busy_ports(settings.local_ports):
        raise ConfigError(f"ports already in use: {busy}; stop what holds them or change the ports")


async def wait_ready(session: aiohttp.ClientSession, base_url: str, progress: Callable[[str], None], *,
                     timeout_s: float) -> None:
    """Wait until the gateway's ``/health/ready`` says its own warm-up request went through both
    legs (the KV connector handshake is then done before users come).

    Raises EngineStartFailed if the warm-up failed or the gateway is not ready within ``timeout_s``.
    """
    started_s = time.monotonic()
    state: dict[str, object] = {"warm_up": "no answer yet"}
    while True:
        try:
            async with session.get(f"{base_url}/health/ready", timeout=aiohttp.ClientTimeout(total=10)) as reply:
                if reply.status == 200:
                    break
                state = await reply.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as exc:  # a gateway busy warming up may answer late
            state = {"warm_up": f"no answer: {exc!r}"}
        if state.get("warm_up") == "failed":
            raise EngineStartFailed(f"warm-up request failed: {state.get('warm_up_error')}")
        if time.monotonic() - started_s > timeout_s:
            raise EngineStartFailed(f"gateway not ready after {timeout_s:.0f} s: {state}")
        await asyncio.sleep(READY_POLL_S)
    progress(f"  warm-up    done     {time.monotonic() - started_s:5.1f}s  (prefill -> KV handoff -> decode)")


async def _first_done(tasks: list[asyncio.Task[None]]) -> None:
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        task.result()


async def _until_stopped(stop: asyncio.Event, work: Coroutine[Any, Any, None]) -> bool:
    """Await ``work``; False if ``stop`` was set first (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait((task, stopper), return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    task.result()
    return True


def ready_line(base_url: str, model: str, elapsed_s: float) -> str:
    return (
        f"ready in {elapsed_s:.0f}s: OpenAI API at {base_url}/v1  (metrics {base_url}/metrics)\n"
        f"  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'"
    )
