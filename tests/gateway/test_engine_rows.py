"""The gateway's rows of engines: load only while fresh, legs summed over workers, loads shared with them."""

from __future__ import annotations

import asyncio

from pdserve.config import parse_settings
from pdserve.gateway.engine_rows import EngineRow, engine_rows, rows_from_json, rows_json, with_leg_counts
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.workers import SharedHealth, merge_exposition
from pdserve.role import Role
from pdserve.routing.load import EngineLoad
from pdserve.routing.pool import Pool


def test_rows_show_an_engines_load_only_while_the_read_is_fresh() -> None:
    pool = Pool(prefill_urls=["http://p:1"], decode_urls=["http://d:1"])
    (prefill,), (decode,) = pool.all(Role.PREFILL), pool.all(Role.DECODE)
    decode.load = EngineLoad(running=3, waiting=1, kv_usage=0.5, prefix_queried_tokens=100, prefix_hit_tokens=40,
                             read_s=99.0)
    prefill.load, prefill.is_healthy = EngineLoad(running=7, read_s=50.0), False
    with pool.in_flight(decode):
        rows = engine_rows(pool, now_s=100.0, max_age_s=10.0)
    assert rows == [
        EngineRow(Role.PREFILL, "http://p:1", is_healthy=False, in_flight=0, routed=0),
        EngineRow(Role.DECODE, "http://d:1", is_healthy=True, in_flight=1, routed=1, running=3, waiting=1,
                  kv_usage=0.5, prefix_hit_rate=0.4, load_age_s=1.0),
    ]
    assert rows_from_json(rows_json(rows)) == rows


def test_with_several_workers_the_legs_are_every_workers_summed() -> None:
    pools = [Pool(decode_urls=["http://d:1"]) for _ in range(2)]
    for pool, legs in zip(pools, (3, 4), strict=True):
        pool.all(Role.DECODE)[0].routed = legs
    merged = merge_exposition([GatewayMetrics(pool).render().decode() for pool in pools]).decode()
    (row,) = with_leg_counts(engine_rows(pools[0], now_s=0.0, max_age_s=1.0), merged)
    assert (row.routed, row.in_flight) == (7, 0)


async def test_worker_zero_shares_each_engines_load_with_the_others() -> None:
    settings = parse_settings({"prefill": {"engines": 0, "urls": ["http://p:1"]},
                               "decode": {"engines": 0, "urls": ["http://d:1"]}, "cache_dir": "/tmp"}, source="test")
    shared = SharedHealth(settings)
    probing, other = Pool(prefill_urls=["http://p:1"], decode_urls=["http://d:1"]), Pool(decode_urls=["http://d:1"])
    probing.all(Role.DECODE)[0].load = EngineLoad(running=2, kv_usage=0.25, kv_capacity_tokens=4096, read_s=12.5)
    shared.publish(probing)
    assert shared.read_loads()[(Role.DECODE, "http://d:1")] == probing.all(Role.DECODE)[0].load
    assert shared.read_loads()[(Role.PREFILL, "http://p:1")] == EngineLoad()  # never read: -inf survives
    follower = asyncio.create_task(shared.follow(other, worker=1, interval_s=0.01))
    await asyncio.sleep(0.05)
    follower.cancel()
    assert other.all(Role.DECODE)[0].load == probing.all(Role.DECODE)[0].load


async def test_a_leg_another_worker_ended_after_the_read_is_taken_off_the_read_in_every_worker() -> None:
    """Worker 0 read the engine while worker 1's leg ran; the leg ended; neither may count it now."""
    settings = parse_settings({"prefill": {"engines": 0, "urls": ["http://p:1"]}, "gateway": {"workers": 2},
                               "decode": {"engines": 0, "urls": ["http://d:1"]}, "cache_dir": "/tmp"}, source="test")
    shared = SharedHealth(settings)
    pools = [Pool(decode_urls=["http://d:1"]) for _ in range(2)]
    (reader,), (other,) = (pool.all(Role.DECODE) for pool in pools)
    with pools[1].in_flight(other):
        reader.take_load(EngineLoad(running=1, read_s=1.0))  # worker 0's scrape
        shared.publish(pools[0])
    assert reader.legs_ended_since_read == 0  # not yet shared
    follower = asyncio.create_task(shared.follow(pools[1], worker=1, interval_s=0.01))
    await asyncio.sleep(0.05)
    follower.cancel()
    shared.share_ended_legs(pools[0], worker=0)
    assert (reader.legs_ended_since_read, other.legs_ended_since_read) == (1, 1)
    assert other.load == reader.load
