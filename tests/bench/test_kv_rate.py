"""bench/gpu/kv_rate.py reads vLLM's NIXL statistics from either of its two outputs and gets the same bandwidth.

The texts below are in vLLM 0.26's formats: the "KV Transfer metrics" line of nixl/stats.py (one logging window,
copied from a decode engine's log on the H200) and the histograms the same module registers, as an engine's
/metrics prints them and as Ray's metrics port re-exports them (vllm/v1/metrics/ray_wrappers.py swaps ':' for
'_'; Ray prefixes ``ray_`` and adds its own labels). Ray's ``_sum`` is each observation at its bucket's midpoint
(ray/_private/telemetry/open_telemetry_metric_recorder.py): RAY_SCRAPE's sums are those, as a Ray 2.58 scrape's
were (1 transfer of up to 128 MiB and 180 of up to 512 MiB gave exactly 6.048186368e10 bytes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]

LOG = ("(APIServer pid=770) INFO 12-04 09:34:13 [metrics.py:103] KV Transfer metrics: Num successful transfers=18, "
       "Avg xfer time (ms)=12.165, P90 xfer time (ms)=18.675, Avg post time (ms)=0.225, P90 post time (ms)=0.45, "
       "Avg MB per transfer=450.0, Throughput (MB/s)=36991.031, Avg number of descriptors=9.9\n")
ENGINE_SCRAPE = """\
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="m"} 18.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 18.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 8.4934656e+09
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.21897
"""
RAY_SCRAPE = """\
ray_vllm_nixl_bytes_transferred_bucket{Component="core_worker",ReplicaId="a",engine="0",le="33554432.0"} 0.0
ray_vllm_nixl_bytes_transferred_bucket{Component="core_worker",ReplicaId="a",engine="0",le="134217728.0"} 1.0
ray_vllm_nixl_bytes_transferred_bucket{Component="core_worker",ReplicaId="a",engine="0",le="536870912.0"} 181.0
ray_vllm_nixl_bytes_transferred_bucket{Component="core_worker",ReplicaId="a",engine="0",le="+Inf"} 181.0
ray_vllm_nixl_bytes_transferred_count{Component="core_worker",ReplicaId="a",engine="0"} 181.0
ray_vllm_nixl_bytes_transferred_sum{Component="core_worker",ReplicaId="a",engine="0"} 6.048186368e+10
ray_vllm_nixl_xfer_time_seconds_bucket{Component="core_worker",ReplicaId="a",engine="0",le="0.025"} 100.0
ray_vllm_nixl_xfer_time_seconds_bucket{Component="core_worker",ReplicaId="a",engine="0",le="0.05"} 181.0
ray_vllm_nixl_xfer_time_seconds_bucket{Component="core_worker",ReplicaId="a",engine="0",le="+Inf"} 181.0
ray_vllm_nixl_xfer_time_seconds_sum{Component="core_worker",ReplicaId="a",engine="0"} 4.29
ray_vllm_nixl_xfer_time_seconds_bucket{Component="core_worker",ReplicaId="b",engine="0",le="0.025"} 0.0
ray_vllm_nixl_xfer_time_seconds_bucket{Component="core_worker",ReplicaId="b",engine="0",le="+Inf"} 1.0
ray_vllm_num_requests_running{Component="core_worker",ReplicaId="a"} 3.0
"""


def kv_rate(tmp_path: Path, *texts: str) -> dict[str, float]:
    paths = []
    for index, text in enumerate(texts):
        paths.append(tmp_path / f"input-{index}.txt")
        paths[-1].write_text(text)
    result = subprocess.run([sys.executable, "bench/gpu/kv_rate.py", *map(str, paths)], cwd=REPO, check=True,
                            capture_output=True, text=True, timeout=30)
    return dict(json.loads(result.stdout))


def test_a_log_window_and_the_histograms_of_the_same_transfers_give_the_same_rate(tmp_path: Path) -> None:
    from_log, from_scrape = kv_rate(tmp_path, LOG), kv_rate(tmp_path, ENGINE_SCRAPE)

    assert from_log == {"transfers": 18, "gb": 8.49, "transfer_s": 0.219, "gb_per_s": 38.8}
    assert from_scrape == from_log


def test_rays_export_gives_the_bounds_its_buckets_hold_not_its_rebuilt_sum(tmp_path: Path) -> None:
    rate = kv_rate(tmp_path, RAY_SCRAPE)

    # bytes: 1 in (32, 128] MiB, 180 in (128, 512] MiB; seconds: 100 in [0, 0.025], 81 in (0.025, 0.05] and
    # replica b's one above its last finite edge, 0.025 s, which leaves the upper bounds open
    assert rate == {"transfers": 181, "gb": None, "transfer_s": None, "gb_per_s": None,
                    "gb_bounds": [24.19, 96.77], "transfer_s_bounds": [2.05, None], "gb_per_s_bounds": [None, 47.2]}


def test_files_add_up_and_nothing_to_read_is_no_rate(tmp_path: Path) -> None:
    assert kv_rate(tmp_path, LOG, ENGINE_SCRAPE)["transfers"] == 36
    assert kv_rate(tmp_path, "no statistics here\n") == {"transfers": 0, "gb": 0.0, "transfer_s": 0.0, "gb_per_s": None}


def test_a_ray_scrape_before_any_transfer_is_no_rate(tmp_path: Path) -> None:
    empty = "".join(f'ray_vllm_nixl_{metric}_bucket{{le="{edge}",replica="a"}} 0\n'
                    for metric, edge in (("bytes_transferred", "1e+06"), ("bytes_transferred", "+Inf"),
                                         ("xfer_time_seconds", "0.1"), ("xfer_time_seconds", "+Inf")))
    assert kv_rate(tmp_path, empty) == {"transfers": 0, "gb": None, "transfer_s": None, "gb_per_s": None,
                                        "gb_bounds": [0.0, 0.0], "transfer_s_bounds": [0.0, 0.0],
                                        "gb_per_s_bounds": [None, None]}
