from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from pdserve.config import Settings, load_settings
from pdserve.engine_key import NO_ENGINE_KEY, EngineKey
from pdserve.errors import EngineStartFailed
from pdserve.gateway.app import build_app
from pdserve.gateway.server import GatewayWorkers
from pdserve.gateway.workers import SharedHealth, Worker, merge_exposition
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine

STREAMS = 16
ENGINE_KEY = EngineKey("engine-key-for-the-workers-0123")


async def test_two_workers_serve_one_port_and_metrics_and_health_count_both() -> None:
    engine = FakeEngine()
    async with serving(engine.app(), free_port()) as engine_url:
        port = free_port()
        settings = _two_workers(engine_url, port)
        workers = GatewayWorkers(settings, engine_key=ENGINE_KEY)  # to each worker through multiprocessing's pipe
        task = asyncio.create_task(workers.serve())
        try:
            await _until_started(workers, task)
            engine.decode_gate = asyncio.Event()  # after warm-up: every decode leg now waits, open, until set
            decode_legs_before = len(_decode_bodies(engine))
            base_url = f"http://127.0.0.1:{port}"
            body = {"model": settings.model.served_name, "prompt": "hi", "max_tokens": 5, "stream": True}

            async def stream() -> str:
                async with httpx.AsyncClient(timeout=30) as client:  # a connection of its own
                    reply = await client.post(f"{base_url}/v1/completions", json=body)
                    return reply.text

            streams = [asyncio.create_task(stream()) for _ in range(STREAMS)]
            while len(_decode_bodies(engine)) < decode_legs_before + STREAMS:  # a condition, not a time
                assert not any(stream.done() for stream in streams)
                await asyncio.sleep(0.02)
            healths = [await _health(base_url) for _ in range(6)]  # whichever worker answers
            serving_pids = {pid for pid, connections in _connections_on(port).items() if connections}
            engine.decode_gate.set()
            texts = await asyncio.gather(*streams)
            assert all("[DONE]" in text for text in texts)
            assert len(serving_pids) == 2, "the kernel spread the clients over both workers"
            assert [_decode_in_flight(health) for health in healths] == [STREAMS] * 6, \
                "/health counts the legs of both workers"
            assert all(health["in_flight_counted"] == {"workers": 2, "of": 2} for health in healths)

            async with httpx.AsyncClient(timeout=10) as client:
                metrics = (await client.get(f"{base_url}/metrics")).text
            served = [line for line in metrics.splitlines()
                      if line.startswith('pdserve_requests_total{') and 'route="/v1/completions"' in line]
            assert sum(float(line.rsplit(" ", 1)[1]) for line in served) == STREAMS
            assert "pdserve_gateway_workers_counted 2.0" in metrics
            assert {headers.get("authorization") for headers in engine.headers} == {f"Bearer {ENGINE_KEY.value}"}
        finally:
            workers.should_exit = True
            await task
    assert not _gateway_workers()


async def test_health_says_when_a_worker_s_legs_are_missing_from_its_count(tmp_path: Path) -> None:
    """A worker that does not answer is left out of the sum (gateway/workers.py, gather_metrics);
    /health says so rather than answering a smaller count as if it were all."""
    async with serving(FakeEngine().app(), free_port()) as engine_url:
        settings = _two_workers(engine_url, free_port())
        worker = Worker(0, 2, tmp_path, SharedHealth(settings))  # worker 1 never started: no socket
        async with serving(build_app(settings, worker=worker), settings.gateway.port) as base_url:
            health = await _health(base_url)
    assert health["in_flight_counted"] == {"workers": 1, "of": 2}


async def test_a_worker_that_dies_stops_the_others_and_the_group_says_which() -> None:
    """The parent waits on the workers' exits rather than polling them (gateway/server.py)."""
    async with serving(FakeEngine().app(), free_port()) as engine_url:
        workers = GatewayWorkers(_two_workers(engine_url, free_port()), engine_key=NO_ENGINE_KEY)
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


async def _health(base_url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as client:  # a new connection: either worker may take it
        body: dict[str, Any] = (await client.get(f"{base_url}/health")).json()
    return body


def _decode_in_flight(health: dict[str, Any]) -> int:
    return sum(engine["in_flight"] for engine in health["engines"]["decode"])


def _decode_bodies(engine: FakeEngine) -> list[dict[str, Any]]:
    return [body for body in engine.bodies if not (body.get("kv_transfer_params") or {}).get("do_remote_decode")]


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
