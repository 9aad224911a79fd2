"""Runs inside every engine of a hybrid model (attention and Mamba-style layers), loaded as its KV connector module
(``kv_connector_module_path``): vLLM's NixlConnector (with pdserve's NIXL progress pause, nixl_progress.py) that

- keeps a prefill request's whole prompt where the request asks (whole_prompt.py says which and why), so its
  sampled token can be the client's first token (pdserve/pd/first_token.py);
- stages the KV in host memory (``kv_buffer_device: cpu``) on a GPU, where vLLM 0.26's own fails at start with
  ``AttributeError: 'list' object has no attribute 'shape'`` (host_mirror.py says why).

vLLM makes the connector's worker inside the connector's constructor, with no hook to choose its class,
so for a hybrid model with a host buffer this connector gives that one worker object three methods of
its own before the KV caches are registered: the host buffer, the copy out after a prefill, and the copy
in after a pull. Everything else (registration, descriptors, handshakes, transfers) is vLLM's.
"""

from __future__ import annotations

import logging
from types import MethodType
from typing import Any

import torch

from pdserve_vllm.host_mirror import HostMirror, mirror_on_host
from pdserve_vllm.nixl_progress import NixlConnector as ProgressNixlConnector
from pdserve_vllm.whole_prompt import keep_whole_prompt, keeps_whole_prompt, mark_reply

__all__ = ["NixlConnector"]
log = logging.getLogger(f"vllm.{__name__}")  # vLLM prints its own logger tree to the engine log


def _pages(block_ids: Any) -> list[int]:
    """Every logical block id of a request, over its KV cache groups."""
    return [block for group in block_ids for block in group]


def _stage_through_mirror(worker: Any) -> None:
    """Give ``worker`` (vLLM's NIXL worker) a host buffer that mirrors the device storages, and block copies
    that move whole pages of them; ``meta.local_block_ids`` are logical block ids, one list per group."""
    mirrors: list[HostMirror] = []

    def initialize_host_xfer_buffer(self: Any, kv_caches: dict[str, Any]) -> None:
        mirror = mirror_on_host(kv_caches, num_pages=self._logical_num_blocks)
        mirrors.append(mirror)
        self.host_xfer_buffers = mirror.views
        self.host_buffer_kv_cache_layout = self.kv_cache_layout  # the host views keep the device layout
        log.info("KV staged in host memory for a hybrid model: %d storages of %d pages mirrored (pdserve)",
                 len(mirror.storages), self._logical_num_blocks)

    def save_kv_to_host(self: Any, metadata: Any) -> None:
        for meta in metadata.reqs_to_save.values():
            meta.local_physical_block_ids = self._logical_to_kernel_block_ids(
                meta.local_block_ids, self._physical_blocks_per_logical_kv_block)
            # a blocking copy: NIXL may read these pages as soon as the decode engine asks
            mirrors[-1].copy_pages(_pages(meta.local_block_ids), to_host=True)

    def sync_recved_kv_to_device(self: Any, req_id: str, meta: Any) -> None:
        mirrors[-1].copy_pages(_pages(meta.local_block_ids), to_host=False)

    worker.initialize_host_xfer_buffer = MethodType(initialize_host_xfer_buffer, worker)
    worker.save_kv_to_host = MethodType(save_kv_to_host, worker)
    worker.sync_recved_kv_to_device = MethodType(sync_recved_kv_to_device, worker)


def prefill_backoff(scheduler: Any) -> int | None:
    """The prompt tokens vLLM keeps off this (prefill) engine's requests; None: a connector scheduler whose
    truncation pdserve does not know, so none keeps its whole prompt."""
    if hasattr(scheduler, "_truncate_request_for_prefill"):  # 0.32: recurrent layers, or a lookahead
        return int(scheduler._prefill_backoff())
    if hasattr(scheduler, "_truncate_mamba_request_for_prefill"):  # 0.26: recurrent layers only
        return 1 if scheduler._has_mamba else 0
    return None


class NixlConnector(ProgressNixlConnector):
    """vLLM's NixlConnector; a prefill that asks keeps its whole prompt, and a hybrid model's KV staged in host
    memory goes through a page mirror."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        scheduler = self.connector_scheduler
        if scheduler is not None and scheduler._has_mamba and prefill_backoff(scheduler) != 1:
            log.warning("pdserve: this NixlConnector keeps %s prompt tokens off a prefill engine, not one: every "
                        "prefill stops short and its token is not the client's first", prefill_backoff(scheduler))

    def on_new_request(self, request: Any) -> None:
        scheduler = self.connector_scheduler
        if scheduler is not None and keeps_whole_prompt(
                request.kv_transfer_params, has_mamba=scheduler._has_mamba, backoff=prefill_backoff(scheduler)):
            keep_whole_prompt(request.kv_transfer_params)
        super().on_new_request(request)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)
        return delay_free, mark_reply(request.kv_transfer_params, params)

    def request_finished_all_groups(  # vLLM's scheduler calls this one for a hybrid (SupportsHMA)
            self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished_all_groups(request, block_ids)
        return delay_free, mark_reply(request.kv_transfer_params, params)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self.connector_worker
        if worker is not None and worker.use_host_buffer and worker._has_mamba:
            _stage_through_mirror(worker)
        super().register_kv_caches(kv_caches)
