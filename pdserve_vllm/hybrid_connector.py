"""Runs inside a GPU engine, loaded as its KV connector module (``kv_connector_module_path``): vLLM's
NixlConnector (with pdserve's NIXL progress pause, nixl_progress.py), able to stage a hybrid model's KV
in host memory (``kv_buffer_device: cpu``), where vLLM 0.26's own fails at start with
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


class NixlConnector(ProgressNixlConnector):
    """vLLM's NixlConnector; a hybrid model's KV staged in host memory goes through a page mirror."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self.connector_worker
        if worker is not None and worker.use_host_buffer and worker._has_mamba:
            _stage_through_mirror(worker)
        super().register_kv_caches(kv_caches)
