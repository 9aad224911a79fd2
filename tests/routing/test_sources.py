from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from pdserve.engines.kv_path import KvPath
from pdserve.role import Role
from pdserve.routing.pool import Pool
from pdserve.routing.sources import FixedEndpoints, RegisteredEndpoints


def test_pool_keeps_known_endpoints_state_when_its_urls_change() -> None:
    pool = Pool(prefill_urls=["http://a:1", "http://b:1/"], decode_urls=[])
    a, _ = pool.all(Role.PREFILL)
    a.in_flight, a.is_healthy = 3, False
    assert not pool.set_urls(Role.PREFILL, ["http://a:1", "http://b:1"])
    assert pool.set_urls(Role.PREFILL, ["http://c:1", "http://a:1"])
    assert [endpoint.url for endpoint in pool.all(Role.PREFILL)] == ["http://c:1", "http://a:1"]
    assert pool.all(Role.PREFILL)[1] is a and a.in_flight == 3 and not a.is_healthy


async def test_fixed_endpoints_fill_the_pool() -> None:
    pool = Pool()
    await FixedEndpoints(prefill_urls=["http://p:1"], decode_urls=["http://d:1", "http://d:2"]).follow(pool)
    assert [e.url for e in pool.all(Role.PREFILL)] == ["http://p:1"]
    assert [e.url for e in pool.all(Role.DECODE)] == ["http://d:1", "http://d:2"]


def test_registrations_expire_unless_renewed(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    registry = RegisteredEndpoints(ttl_s=10.0)
    registry.register(Role.DECODE, "http://d:1")
    registry.register(Role.DECODE, "http://d:2")
    registry.register(Role.PREFILL, "http://p:1")
    now[0] = 108.0
    registry.register(Role.DECODE, "http://d:2")  # renewed; d:1 is not
    now[0] = 112.0
    assert registry.current(Role.DECODE) == ["http://d:2"]
    assert registry.current(Role.PREFILL) == []
    registry.unregister(Role.DECODE, "http://d:2")
    assert registry.current(Role.DECODE) == []


def test_a_gateway_copy_follows_the_registry_and_keeps_its_engines_while_a_restarted_one_fills() -> None:
    registry, copy = RegisteredEndpoints(ttl_s=10.0), RegisteredEndpoints(ttl_s=float("inf"))
    registry.register(Role.DECODE, "http://d:1", kv_path=KvPath(("UCX",), ()))
    registry.register(Role.PREFILL, "http://p:1")
    copy.mirror(registry.snapshot())
    assert copy.snapshot() == registry.snapshot()
    registry.unregister(Role.DECODE, "http://d:1")
    copy.mirror(registry.snapshot(), keep_missing=True)  # a registry restarted moments ago
    assert copy.current(Role.DECODE) == ["http://d:1"]
    copy.mirror(registry.snapshot())
    assert copy.current(Role.DECODE) == [] and copy.current(Role.PREFILL) == ["http://p:1"]


async def test_following_registrations_updates_the_pool_and_what_engines_report() -> None:
    registry, pool = RegisteredEndpoints(ttl_s=60.0, sync_interval_s=0.01), Pool()
    follower = asyncio.create_task(registry.follow(pool))
    try:
        registry.register(Role.PREFILL, "http://p:1", kv_path=KvPath(("UCX",), ("cma/memory (intra-node)",)))
        registry.register(Role.DECODE, "http://d:1")
        await asyncio.sleep(0.05)
        [prefill] = pool.all(Role.PREFILL)
        assert prefill.url == "http://p:1" and prefill.kv_path.backends == ("UCX",)
        assert prefill.kv_path.transports == ("cma/memory (intra-node)",)
        registry.unregister(Role.DECODE, "http://d:1")
        await asyncio.sleep(0.05)
        assert pool.all(Role.DECODE) == []
    finally:
        follower.cancel()


async def test_engines_launched_here_report_their_kv_path_from_their_logs(tmp_path: Path) -> None:
    log = tmp_path / "decode-0.log"
    log.write_text("=== pdserve: kv buffer cpu: CPU engine\nNIXL INFO Backend UCX was instantiated\n")
    pool = Pool()
    source = FixedEndpoints(prefill_urls=[], decode_urls=["http://d:1"], kv_logs={"http://d:1": log})
    following = asyncio.create_task(source.follow(pool))
    await asyncio.sleep(0.05)
    following.cancel()
    (decode,) = pool.all(Role.DECODE)
    assert decode.kv_path == KvPath(backends=("UCX",), buffer_device="cpu", buffer_reason="CPU engine")
