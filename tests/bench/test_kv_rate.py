"""bench/gpu/kv_rate.py reads vLLM's NIXL statistics from either of its two outputs and gets the same bandwidth.

The texts below are in vLLM 0.26's formats: the "KV Transfer metrics" line of nixl/stats.py (one logging window,
copied from a decode engine's log on the H200) and the histograms the same module registers, as an engine's
/metrics prints them and as Ray's metrics port re-exports them (vllm/v1/metrics/ray_wrappers.py swaps ':' for
'_'; Ray prefixes ``ray_`` and adds its own labels).
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
ray_vllm_nixl_bytes_transferred_count{Component="core_worker",ReplicaId="a",engine="0"} 481.0
ray_vllm_nixl_bytes_transferred_sum{Component="core_worker",ReplicaId="a",engine="0"} 1.162870784e+11
ray_vllm_nixl_xfer_time_seconds_sum{Component="core_worker",ReplicaId="a",engine="0"} 19.0
ray_vllm_nixl_xfer_time_seconds_sum{Component="core_worker",ReplicaId="b",engine="0"} 1.0
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


def test_rays_export_is_summed_over_replicas_and_other_series_are_ignored(tmp_path: Path) -> None:
    assert kv_rate(tmp_path, RAY_SCRAPE) == {"transfers": 481, "gb": 116.29, "transfer_s": 20.0, "gb_per_s": 5.8}


def test_files_add_up_and_nothing_to_read_is_no_rate(tmp_path: Path) -> None:
    assert kv_rate(tmp_path, LOG, ENGINE_SCRAPE)["transfers"] == 36
    assert kv_rate(tmp_path, "no statistics here\n") == {"transfers": 0, "gb": 0.0, "transfer_s": 0.0, "gb_per_s": None}
