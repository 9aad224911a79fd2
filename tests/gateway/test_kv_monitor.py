"""Slow KV handoffs warn about the transport only when the decode engine's own transfers were slow;
otherwise they are load, noted at INFO at most once per interval."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Sequence

import aiohttp
import pytest

from pdserve.gateway.app import build_app
from pdserve.gateway.engine_state import EngineState, parse_engine_state
from pdserve.gateway.handoffs import Handoffs, HandoffTally
from pdserve.gateway.kv_monitor import READ_PREFIXES, KVMonitor, Reading, select_samples
from pdserve.gateway.metrics import EngineKVCollector
from pdserve.gateway_config import GatewaySpec
from pdserve.pd.transfer_stats import TransferCounters, parse_counters
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, gateway_settings, post

URL = "http://decode"
LOGGER = "pdserve.gateway.kv_monitor"
_BOUNDS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)  # vLLM's nixl/stats.py


def vllm_metrics(transfers_s: Sequence[float], *, waiting: int = 0, running: int = 0, engine: str = "0") -> str:
    """What a vLLM decode engine core's /metrics says after KV transfers of these durations, 0.1 MB each."""
    labels = f'engine="{engine}",model_name="m"'
    buckets = [f'vllm:nixl_xfer_time_seconds_bucket{{{labels},le="{bound}"}} {sum(t <= bound for t in transfers_s)}'
               for bound in _BOUNDS_S]
    buckets.append(f'vllm:nixl_xfer_time_seconds_bucket{{{labels},le="+Inf"}} {len(transfers_s)}')
    return "\n".join([
        "# TYPE vllm:nixl_xfer_time_seconds histogram", *buckets,
        f"vllm:nixl_xfer_time_seconds_count{{{labels}}} {len(transfers_s)}",
        f"vllm:nixl_xfer_time_seconds_sum{{{labels}}} {sum(transfers_s)}",
        "# TYPE vllm:nixl_bytes_transferred histogram",
        f"vllm:nixl_bytes_transferred_sum{{{labels}}} {1e5 * len(transfers_s)}",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{labels}}} {waiting}",
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{labels}}} {running}", "",
    ])


def reading(transfers_s: Sequence[float], *, waiting: int = 0, running: int = 0) -> Reading:
    text = vllm_metrics(transfers_s, waiting=waiting, running=running)
    return Reading(parse_counters(text), parse_engine_state(text, slow_transfer_s=1.0))


def kv_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == LOGGER and record.levelno == level]


def test_engine_state_counts_only_transfers_that_were_slow_on_their_own() -> None:
    text = vllm_metrics([0.002, 0.3, 0.9, 1.5], waiting=2, running=3) + vllm_metrics([7.0], running=1, engine="1")
    assert parse_engine_state(text, slow_transfer_s=1.0) == EngineState(waiting=2, running=4, slow_transfers=2)
    # 0.8 s is no bucket bound: the next one up (1 s) decides, so the 0.9 s transfer is not counted
    assert parse_engine_state(text, slow_transfer_s=0.8).slow_transfers == 2
    assert parse_engine_state(text, slow_transfer_s=0.25).slow_transfers == 3  # over 0.3 s: 0.9, 1.5, 7.0
    assert parse_engine_state(text, slow_transfer_s=10.0).slow_transfers == 0
    assert parse_engine_state("", slow_transfer_s=1.0) == EngineState()


def test_the_monitor_parses_only_the_samples_it_needs_and_reads_the_same() -> None:
    noise = ('vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9\n'
             'vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf"} 4\n'
             'vllm:generation_tokens_total{engine="0"} 100\n')
    text = noise + vllm_metrics([0.002, 1.5], waiting=2, running=3)
    selected = select_samples(text, READ_PREFIXES)
    assert "by_reason" not in selected and "# TYPE" not in selected
    assert parse_counters(selected) == parse_counters(text) == TransferCounters(bytes=2e5, seconds=1.502, transfers=2)
    assert parse_engine_state(selected, slow_transfer_s=1.0) == EngineState(waiting=2, running=3, slow_transfers=1)


def test_handoff_queue_part_is_the_handoff_less_the_engines_mean_transfer_time() -> None:
    handoffs = Handoffs(slow_s=1.0)
    assert handoffs.record(URL, 1.5) == 1.5  # no transfer time known yet
    assert handoffs.take(URL, transfer_s=0.2) == HandoffTally(count=1, slow=1, slowest_s=1.5)
    assert handoffs.record(URL, 1.5) == pytest.approx(1.3)
    assert handoffs.record(URL, 0.1) == 0.0
    assert handoffs.take(URL, transfer_s=None) == HandoffTally(count=2, slow=1, slowest_s=1.5)
    assert handoffs.take(URL, transfer_s=None) == HandoffTally()


def monitor(handoffs: Handoffs) -> KVMonitor:
    return KVMonitor(spec=GatewaySpec(busy_log_interval_s=60.0), handoffs=handoffs, collector=EngineKVCollector())


def test_slow_handoffs_with_fast_transfers_are_load_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    handoffs = Handoffs(slow_s=1.0)
    kv = monitor(handoffs)
    for handoff_s in (1.5, 2.5, 0.1):
        handoffs.record(URL, handoff_s)
    kv.judge(URL, reading([0.003] * 3, waiting=5, running=4), now_s=100.0)
    assert kv_lines(caplog, logging.WARNING) == []
    (line,) = kv_lines(caplog, logging.INFO)
    assert "busy: 2 of 3 handoff(s) took over 1000 ms" in line and "slowest 2500 ms" in line
    assert "3 KV transfer(s) took 3.0 ms on average" in line and "waiting=5 running=4" in line

    handoffs.record(URL, 3.0)
    kv.judge(URL, reading([0.003] * 4, waiting=7), now_s=110.0)
    assert len(kv_lines(caplog, logging.INFO)) == 1  # within the interval: held, not dropped
    kv.judge(URL, reading([0.003] * 4), now_s=161.0)
    assert "busy: 1 of 1 handoff(s)" in kv_lines(caplog, logging.INFO)[-1]
    assert "waiting=7" in kv_lines(caplog, logging.INFO)[-1]
    handoffs.record(URL, 4.0)
    kv.judge(URL, reading([0.003] * 5), now_s=170.0)
    kv.flush()  # the gateway stops within the interval: the held spell is still logged
    assert len(kv_lines(caplog, logging.INFO)) == 3 and "slowest 4000 ms" in kv_lines(caplog, logging.INFO)[-1]
    kv.flush()
    assert len(kv_lines(caplog, logging.INFO)) == 3
    assert kv_lines(caplog, logging.WARNING) == []


def test_a_transfer_slow_on_its_own_warns_about_the_transport(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    handoffs = Handoffs(slow_s=1.0)
    kv = monitor(handoffs)
    handoffs.record(URL, 1.8)
    # 1 GB in 1.5 s is fast on average; the warning comes from that one transfer's own time
    slow = Reading(TransferCounters(bytes=1e9, seconds=1.5, transfers=1), EngineState(slow_transfers=1))
    kv.judge(URL, slow, now_s=100.0)
    (warning,) = kv_lines(caplog, logging.WARNING)
    assert warning.startswith(f"SLOW KV transfer to decode engine {URL}: 1 transfer(s) alone took over 1000 ms")
    assert "pdserve verify" in warning and "1 of 1 handoff(s)" in warning
    kv.judge(URL, slow, now_s=105.0)  # the same cumulative counts: nothing new in this window
    assert len(kv_lines(caplog, logging.WARNING)) == 1
    assert kv_lines(caplog, logging.INFO) == []


@pytest.fixture
async def slow_engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    """Its first token comes 0.2 s after the decode request: a slow handoff at a 0.1 s threshold."""
    fake = FakeEngine(token_delay_s=0.2, metrics_text=vllm_metrics([]))
    async with serving(fake.app(), free_port()) as url:
        yield fake, url


async def serve_one_request(url: str, caplog: pytest.LogCaptureFixture, *, fake: FakeEngine, transfers_s: list[float],
                            expect_level: int) -> str:
    """One streamed request through a gateway on ``url``; ``fake`` reports ``transfers_s`` once it
    starts decoding. Returns the gateway's /metrics once a line at ``expect_level`` was logged."""
    settings = gateway_settings(prefill=[url], decode=[url], slow_handoff_warn_s=0.1, kv_scrape_interval_s=1.0)
    async with serving(build_app(settings), settings.gateway.port) as base:
        # Reported as the first token goes out, not before: a read in between would see the
        # transfer before the gateway has timed its handoff, and judge the two in different windows.
        fake.metrics_when_decoding = vllm_metrics(transfers_s, waiting=1, running=2)
        assert (await post(base, {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}))[0] == 200
        for _ in range(50):
            if kv_lines(caplog, expect_level):
                break
            await asyncio.sleep(0.1)
        async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as reply:
            return await reply.text()


async def test_gateway_warns_when_the_engine_reports_slow_transfers(
    slow_engine: tuple[FakeEngine, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    fake, url = slow_engine
    await serve_one_request(url, caplog, fake=fake, transfers_s=[0.15], expect_level=logging.WARNING)
    (warning,) = kv_lines(caplog, logging.WARNING)
    assert warning.startswith("SLOW KV transfer") and "pdserve verify" in warning
    assert re.search(r"[1-9] of [1-9] handoff\(s\) took over 100 ms", warning)


async def test_gateway_calls_slow_handoffs_with_fast_transfers_load(
    slow_engine: tuple[FakeEngine, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    fake, url = slow_engine
    metrics = await serve_one_request(url, caplog, fake=fake, transfers_s=[0.003], expect_level=logging.INFO)
    assert kv_lines(caplog, logging.WARNING) == []
    (line,) = kv_lines(caplog, logging.INFO)
    assert "busy" in line and "load not transport" in line and "waiting=1 running=2" in line
    queue_count = re.search(r"^pdserve_kv_handoff_queue_seconds_count (\S+)", metrics, re.MULTILINE)
    assert queue_count and float(queue_count.group(1)) >= 1
