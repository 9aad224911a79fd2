"""Waiting for an engine that left the gateway's pool to finish what it holds, read from its /metrics."""

from __future__ import annotations

import time

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdserve.engines import drain
from pdserve.engines.drain import wait_until_idle
from tests.conftest import free_port, serving
from tests.routing.test_load import vllm_load_metrics

BUSY, IDLE = vllm_load_metrics(running=2, waiting=1, kv_usage=0.3), vllm_load_metrics()


@pytest.fixture(autouse=True)
def fast_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drain, "DRAIN_GRACE_S", 0.05)
    monkeypatch.setattr(drain, "DRAIN_POLL_S", 0.02)


def engine_reading(*texts: str) -> tuple[Starlette, list[str]]:
    """An engine whose /metrics gives ``texts`` in turn, then the last for ever; and what it gave."""
    given: list[str] = []

    def metrics(_request: Request) -> Response:
        given.append(texts[min(len(given), len(texts) - 1)])
        return Response(given[-1], media_type="text/plain")

    return Starlette(routes=[Route("/metrics", metrics)]), given


async def wait(url: str, *, is_running: bool = True, timeout_s: float = 5.0) -> tuple[bool, float]:
    """(whether the engine at ``url`` went idle, seconds it took)."""
    started_s = time.monotonic()
    async with aiohttp.ClientSession() as session:
        is_idle = await wait_until_idle(session, url, is_running=lambda: is_running, timeout_s=timeout_s,
                                        read_timeout_s=1.0)
    return is_idle, time.monotonic() - started_s


async def test_the_wait_ends_on_the_second_idle_read_in_a_row() -> None:
    app, given = engine_reading(BUSY, IDLE, BUSY, IDLE, IDLE)  # one idle read between busy ones is not enough
    async with serving(app, free_port()) as url:
        assert (await wait(url))[0]
    assert len(given) == 5


async def test_a_prefill_engine_holding_a_handoffs_blocks_is_not_idle() -> None:
    # No request left, but KV blocks in use: a prompt's KV that the decode engine has not pulled yet.
    app, _ = engine_reading(vllm_load_metrics(kv_usage=0.1))
    async with serving(app, free_port()) as url:
        assert await wait(url, timeout_s=0.5) == (False, pytest.approx(0.5, abs=0.3))


async def test_an_engine_that_does_not_answer_counts_as_busy_and_one_that_exited_as_idle() -> None:
    silent = f"http://127.0.0.1:{free_port()}"
    assert (await wait(silent, timeout_s=0.5))[0] is False
    is_idle, waited_s = await wait(silent, is_running=False)
    assert is_idle and waited_s < 0.05  # no grace to wait out: nothing can reach it
