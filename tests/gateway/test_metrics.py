from __future__ import annotations

from pdserve.engines.kv_path import KvPath
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.pd.transfer_stats import TransferCounters
from pdserve.role import Role
from pdserve.routing.pool import Pool


def test_engine_kv_counters_carry_each_engines_backend_and_provider() -> None:
    pool = Pool(decode_urls=["http://d:1", "http://d:2"])
    efa, _unreported = pool.all(Role.DECODE)
    efa.kv_path = KvPath(backends=("LIBFABRIC",), provider="efa")
    metrics = GatewayMetrics(pool)
    metrics.engine_kv.latest = {url: TransferCounters(bytes=2e6, seconds=0.001, transfers=1.0, failed=0.0)
                                for url in ("http://d:1", "http://d:2")}
    text = metrics.render().decode()
    assert 'pdserve_engine_kv_transfer_bytes_total{backend="LIBFABRIC",endpoint="http://d:1",provider="efa"} 2e+06' in text
    assert 'pdserve_engine_kv_transfers_total{backend="",endpoint="http://d:2",provider=""} 1.0' in text
