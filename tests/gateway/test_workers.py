from __future__ import annotations

import asyncio

import httpx
import psutil
import pytest

from pdserve.config import Settings, load_settings
from pdserve.errors import EngineStartFailed
from pdserve.gateway.server import GatewayWorkers
from pdserve.gateway.workers import merge_exposition
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine

STREAMS = 16


async def test_two_workers_serve_one_port_and_metrics_and_health_count_both() -> None:
    engine = FakeEngine(token_delay_s=0.3)  # each stream lasts ~1.5 s: all are open at once
    async with serving(engine.app(), free_port()) as engine_url:
        port = free_port()
        settings = _two_workers(engine_url, port)
        workers = GatewayWorkers(settings)
        task = asyncio.create_task(workers.serve())
        try:
            await _until_started(workers, task)
            base_url = f"http://127.0.0.1:{port}"
            body = {"model": settings.model.served_name, "prompt": "hi", "max_tokens": 5, "stream": True}

            async def stream() -> str:
                async with httpx.AsyncClient(timeout=10) as client:  # a connection of its own
                    reply = await client.post(f"{base_url}/v1/completions", json=body)
                    return reply.text

            streams = [asyncio.create_task(stream()) for _ in range(STREAMS)]
            await asyncio.sleep(0.5)
            decode_legs = [await _decode_in_flight(base_url) for _ in range(6)]  # whichever worker answers
            serving_pids = {pid for pid, connections in _connections_on(port).items() if connections}
            texts = await asyncio.gather(*streams)
            assert all("[DONE]" in text for text in texts)
            assert len(serving_pids) == 2, "the kernel spread the clients over both workers"
            assert decode_legs == [STREAMS] * 6, "/health counts the legs of both workers"

            async with httpx.AsyncClient(timeout=10) as client:
                metrics = (await client.get(f"{base_url}/metrics")).text
            served = [line for line in metrics.splitlines()
                      if line.startswith('pdserve_requests_total{') and 'route="/v1/completions"' in line]
            assert sum(float(line.rsplit(" ", 1)[1]) for line in served) == STREAMS
        finally:
            workers.should_exit = True
            await task
    assert not _gateway_workers()


async def test_a_worker_that_dies_stops_the_others_and_the_group_says_which() -> None:
    """The parent waits on the workers' exits rather than polling them (gateway/server.py)."""
    async with serving(FakeEngine().app(), free_port()) as engine_url:
        workers = GatewayWorkers(_two_workers(engine_url, free_port()))
        task = asyncio.create_task(workers.serve())
        try:
            await _until_started(workers, task)
            _gateway_workers()[0].kill()
            with pytest.raises(EngineStartFailed, match=r"gateway worker pdserve-gateway-\d exited \(-9\)"):
                await asyncio.wait_for(task, timeout=5)
        finally:
            workers.should_exit = True
            await asyncio.gather(task, return_exceptions=True)
    assert not _gateway_workers()


async def _decode_in_flight(base_url: str) -> int:
    async with httpx.AsyncClient(timeout=10) as client:  # a new connection: either worker may take it
        engines = (await client.get(f"{base_url}/health")).json()["engines"]
    return sum(engine["in_flight"] for engine in engines["decode"])


def _two_workers(engine_url: str, port: int) -> Settings:
    return load_settings(overrides={
        "prefill.urls": [engine_url], "prefill.engines": 0, "decode.urls": [engine_url], "decode.engines": 0,
        "gateway.port": port, "gateway.workers": 2,
    })


async def _until_started(workers: GatewayWorkers, task: asyncio.Task[None]) -> None:
    while not workers.started:
        assert not task.done(), task.exception()
        await asyncio.sleep(0.05)


def _gateway_workers() -> list[psutil.Process]:
    return [child for child in psutil.Process().children() if "spawn_main" in " ".join(child.cmdline())]


def _connections_on(port: int) -> dict[int, int]:
    """Established client connections on ``port`` by gateway worker pid."""
    found: dict[int, int] = {}
    for child in _gateway_workers():
        found[child.pid] = sum(1 for connection in child.net_connections(kind="tcp")
                               if connection.laddr.port == port and connection.status == psutil.CONN_ESTABLISHED)
    return found


def test_merged_metrics_sum_samples_and_keep_the_earliest_created() -> None:
    one = ('# HELP jobs_total Jobs.\n# TYPE jobs_total counter\njobs_total{kind="a"} 2.0\n'
           'jobs_created{kind="a"} 100.0\n')
    two = ('# HELP jobs_total Jobs.\n# TYPE jobs_total counter\njobs_total{kind="a"} 3.0\n'
           'jobs_created{kind="a"} 50.0\njobs_total{kind="b"} 1.0\n')
    merged = merge_exposition([one, two]).decode()
    assert 'jobs_total{kind="a"} 5.0' in merged
    assert 'jobs_created{kind="a"} 50.0' in merged
    assert 'jobs_total{kind="b"} 1.0' in merged


def test_merged_histograms_keep_bucket_order() -> None:
    text = ('# HELP gap_seconds Gaps.\n# TYPE gap_seconds histogram\n'
            'gap_seconds_bucket{le="0.1"} 1.0\ngap_seconds_bucket{le="+Inf"} 2.0\n'
            'gap_seconds_count 2.0\ngap_seconds_sum 0.3\n')
    merged = merge_exposition([text, text]).decode().splitlines()
    buckets = [line for line in merged if line.startswith("gap_seconds_bucket")]
    assert buckets == ['gap_seconds_bucket{le="0.1"} 2.0', 'gap_seconds_bucket{le="+Inf"} 4.0']
