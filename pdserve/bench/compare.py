"""``pdserve bench compare``: start the engines once and run one workload against up to three ways
of serving with them, interleaved level by level:

  direct         whole requests to a single engine
  aggregated     whole requests spread round-robin over all the engines
  disaggregated  pdserve's gateway: prefill on the prefill engines, decode on the decode engines
  auto           pdserve's gateway deciding per request (routing.disaggregation: auto), on the next port

Every engine runs with its KV connector; whole requests simply never use it. The decode engines'
own transfer counters over the whole sweep give the KV handoff bandwidth under load; the gateway's
histograms give the handoff as each disaggregated request waited for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import aiohttp

from pdserve.access import load_access_keys
from pdserve.bench import runner
from pdserve.bench.leg_times import LegTimes, fetch_leg_times
from pdserve.bench.points import Point
from pdserve.bench.prompts import PromptMaker, prompt_maker
from pdserve.bench.stats import Slo
from pdserve.bench.sweep import Load, ProgressBar, Workload, sweep
from pdserve.bench.workload import BenchRequest, Lengths, synthetic
from pdserve.config import Settings
from pdserve.engine_key import EngineKey, deployment_engine_key, engine_session
from pdserve.engines.supervisor import Supervisor
from pdserve.errors import BenchFailed
from pdserve.gateway.app import build_app
from pdserve.gateway.connections import connection_limits
from pdserve.gateway.server import make_server
from pdserve.pd.transfer_stats import TransferCounters, fetch_counters
from pdserve.role import Role

_WARM_UP_REQUESTS = 4


class Way(StrEnum):
    """A way of serving with the same engines."""

    DIRECT = "direct"
    AGGREGATED = "aggregated"
    DISAGGREGATED = "disaggregated"
    AUTO = "auto"


# The ways served through a gateway of their own, with the routing.disaggregation each runs with.
_GATEWAY_WAYS = {Way.DISAGGREGATED: "always", Way.AUTO: "auto"}


@dataclass(frozen=True, slots=True)
class CompareResult:
    points: list[Point]
    kv: TransferCounters  # summed over the decode engines, the whole sweep (warm-up excluded)
    legs: LegTimes | None  # the gateway's, the whole sweep; None when no disaggregated way ran


async def run_compare(
    settings: Settings, loads: Sequence[Load], *, ways: Sequence[Way], input_tokens: Lengths, output_tokens: Lengths,
    slo: Slo, timeout_s: float, progress: Callable[[str], None], bar: ProgressBar,
) -> CompareResult:
    """Start ``settings``' engines and gateway, sweep ``loads`` over ``ways``, stop all."""
    from pdserve.up import resolve_layout, resolve_model  # builds the demo model; torch loads slowly

    model_path = await resolve_model(settings, progress=progress)
    layout = await resolve_layout(model_path, progress=progress)
    prompts = prompt_maker(Path(model_path) / "tokenizer.json")

    def workload(count: int, salt: int) -> list[BenchRequest]:
        return synthetic(count, model=settings.model.served_name, input_tokens=input_tokens,
                         output_tokens=output_tokens, prompts=prompts, seed=0, salt=salt)

    with deployment_engine_key(settings.gateway, run_dir=settings.run_dir) as engine_key:
        supervisor = Supervisor(settings, model_path=model_path, layout=layout, progress=progress,
                                engine_key=engine_key)
        progress(f"starting {len(supervisor.engines)} engine(s)")
        async with engine_session(engine_key) as engines:
            await supervisor.start_all(engines)
            try:
                return await _compare(settings, loads, ways=ways, engine_key=engine_key, engines=engines,
                                      workload=workload, prompts=prompts, slo=slo, timeout_s=timeout_s, bar=bar)
            finally:
                progress("stopping engines ...")
                await supervisor.stop_all()


async def _compare(
    settings: Settings, loads: Sequence[Load], *, ways: Sequence[Way], engine_key: EngineKey,
    engines: aiohttp.ClientSession, workload: Workload, prompts: PromptMaker, slo: Slo, timeout_s: float,
    bar: ProgressBar,
) -> CompareResult:
    """The sweep, once the engines answer: ``engines`` (a session) and the gateways carry their key."""
    # the gateways' /metrics want the admin key where the configuration sets keys
    admin = load_access_keys(settings.gateway).headers()
    async with contextlib.AsyncExitStack() as gateways, aiohttp.ClientSession(headers=admin) as gateway_session:
        gateway_urls = {way: await gateways.enter_async_context(_serving_gateway(
                            _gateway_settings(settings, way, n), engine_key=engine_key))
                        for n, way in enumerate(way for way in _GATEWAY_WAYS if way in ways)}
        targets = _targets(settings, gateway_urls, ways, engine_key=engine_key)
        gateway_url = next(iter(gateway_urls.values()), "")  # the legs' times come from the first
        await warm_up_targets(targets, prompts=prompts, model=settings.model.served_name)
        decode_urls = settings.endpoint_urls(Role.DECODE)
        before = await _kv_counters(engines, decode_urls)
        legs_before = await fetch_leg_times(gateway_session, gateway_url, timeout_s=10.0) if gateway_url else None
        points = await sweep(targets, loads, workload=workload, slo=slo, timeout_s=timeout_s, progress=bar)
        kv = (await _kv_counters(engines, decode_urls)).since(before)
        legs = None if legs_before is None else (
            await fetch_leg_times(gateway_session, gateway_url, timeout_s=10.0)).since(legs_before)
        return CompareResult(points=points, kv=kv, legs=legs)


def _targets(settings: Settings, gateway_urls: dict[Way, str], ways: Sequence[Way], *,
             engine_key: EngineKey) -> list[runner.Target]:
    """The ways as targets: direct and aggregated go to the engines, with their key; the gateways get none."""
    prefill, decode = settings.endpoint_urls(Role.PREFILL), settings.endpoint_urls(Role.DECODE)
    if not prefill or not decode:
        raise BenchFailed("compare needs at least one prefill and one decode engine")
    urls = {Way.DIRECT: (decode[0],), Way.AGGREGATED: tuple(prefill + decode)}
    urls |= {way: (url,) for way, url in gateway_urls.items()}
    headers = tuple(engine_key.headers().items())
    return [runner.Target(way.value, urls[way], () if way in gateway_urls else headers) for way in ways]


def _gateway_settings(settings: Settings, way: Way, offset: int) -> Settings:
    """The gateway of ``way``: its routing.disaggregation, on the configured port + ``offset``."""
    gateway = settings.gateway.model_copy(update={"port": settings.gateway.port + offset})
    routing = settings.routing.model_copy(update={"disaggregation": _GATEWAY_WAYS[way]})
    return settings.model_copy(update={"gateway": gateway, "routing": routing})


async def _kv_counters(session: aiohttp.ClientSession, urls: Sequence[str]) -> TransferCounters:
    readings = await asyncio.gather(*(fetch_counters(session, url, timeout_s=10.0) for url in urls))
    total = TransferCounters()
    for reading in readings:
        total = total.plus(reading)
    return total


async def warm_up_targets(targets: Sequence[runner.Target], *, prompts: PromptMaker, model: str) -> None:
    """A few requests per engine and through the gateway, so first-use costs (compilation, the
    KV connector's handshake) are not measured. Raises BenchFailed if any of them fails.
    """
    requests = synthetic(_WARM_UP_REQUESTS, model=model, input_tokens=Lengths(16, 16),
                         output_tokens=Lengths(4, 4), prompts=prompts, seed=1)
    async with runner.new_session() as session:
        for target in targets:
            for url in target.urls:
                for request in requests:
                    record = await runner.send(session, target.name, url, request, timeout_s=120.0,
                                               headers=target.headers)
                    if record.error is not None:
                        raise BenchFailed(f"warm-up request to {target.name} ({url}) failed: {record.error}")


@contextlib.asynccontextmanager
async def _serving_gateway(settings: Settings, *, engine_key: EngineKey) -> AsyncIterator[str]:
    """The real gateway in this process: the engines, not this loop, are the bottleneck here."""
    host, port = "127.0.0.1", settings.gateway.port
    server = make_server(build_app(settings, engine_key=engine_key), host=host, port=port,
                         limits=connection_limits(settings))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise BenchFailed(f"gateway did not start on {host}:{port}")
        await asyncio.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await task
