"""Runs inside every engine of a hybrid model (attention and Mamba-style layers), loaded as its KV connector module
(``kv_connector_module_path``): vLLM's NixlConnector (with pdserve's NIXL progress pause and keyed side channel,
installed as nixl_progress.py is imported) that

- keeps a prefill request's whole prompt where the request asks (whole_prompt.py says which and why), so its
  sampled token can be the client's first token (pdserve/pd/first_token.py);
- has a decode request given that token as output load the whole prompt and undo its recompute of the prompt's last
  token (restore_last.py): the scheduler side names the blocks that step writes in its metadata; the worker side
  copies them before that step's forward (``bind_connector_metadata``) and writes them back after it
  (``wait_for_save``);
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

from pdserve_vllm.contract import Hook
from pdserve_vllm.contract_check import require

require(Hook.HYBRID_CONNECTOR)  # before vLLM's imports: a release without these names is refused by name (contract.py)

import torch
from vllm.v1.kv_cache_interface import MambaSpec

from pdserve_vllm import RESTORE_LAST_KEY, restore_last
from pdserve_vllm.host_mirror import HostMirror, mirror_on_host
from pdserve_vllm.kv_integrity import cache_views
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
    """vLLM's NixlConnector; a prefill that asks keeps its whole prompt, a decode request that asks undoes its
    recompute of the prompt's last token, and a hybrid model's KV staged in host memory goes through a page mirror."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._restores: dict[str, int] = {}  # decode request id -> its prompt tokens, until it recomputes the last
        self._layers: dict[int, list[torch.Tensor]] = {}  # KV cache group -> its layers' caches, indexed by block
        self._kept_states: list[tuple[torch.Tensor, int, torch.Tensor]] = []  # (tensor, block, copy) over a step
        scheduler = self.connector_scheduler
        if scheduler is not None and scheduler._has_mamba and prefill_backoff(scheduler) != 1:
            log.warning("pdserve: this NixlConnector keeps %s prompt tokens off a prefill engine, not one: every "
                        "prefill stops short and its token is not the client's first", prefill_backoff(scheduler))

    def on_new_request(self, request: Any) -> None:
        scheduler = self.connector_scheduler
        params = request.kv_transfer_params
        if scheduler is not None and keeps_whole_prompt(
                params, has_mamba=scheduler._has_mamba, backoff=prefill_backoff(scheduler)) and (
                not params.get(RESTORE_LAST_KEY) or restore_last.restores(
                    request.num_prompt_tokens, state_block_size=_cached_state_block_size(self._kv_cache_config))):
            keep_whole_prompt(params)
        super().on_new_request(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        scheduler = self.connector_scheduler
        if num_external_tokens and scheduler is not None and restore_last.asks_restore_last(
                request.kv_transfer_params, has_mamba=scheduler._has_mamba):
            self._restores[request.request_id] = request.num_prompt_tokens
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        scheduler = self.connector_scheduler
        if scheduler is not None and restore_last.asks_restore_last(request.kv_transfer_params,
                                                                    has_mamba=scheduler._has_mamba):
            count = request.num_prompt_tokens - num_computed_tokens  # all of it: vLLM recomputes the last
            return (count, True) if count > 0 else (0, False)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        # vLLM hands its metadata object to the workers as it is (pickled): one attribute more rides along
        meta.pdserve_kept_states = self._restored_over(scheduler_output)
        return meta

    def _restored_over(self, scheduler_output: Any) -> list[tuple[int, int]]:
        """The blocks of the decode requests whose recompute of the last prompt token is this step
        (restore_last.py); a request scheduled otherwise (recomputing its whole prompt after a preemption) has none."""
        config, kept = self._kv_cache_config, []
        for new in scheduler_output.scheduled_new_reqs:
            prompt_tokens = self._restores.pop(new.req_id, None)
            if prompt_tokens is not None and new.num_computed_tokens == prompt_tokens - 1:
                kept += restore_last.kept_blocks(tuple(new.block_ids), num_prompt_tokens=prompt_tokens,
                                                 state_groups=_state_groups(config),
                                                 attention_block_sizes=_attention_block_sizes(config))
        for req_id in scheduler_output.scheduled_cached_reqs.req_ids:
            self._restores.pop(req_id, None)
        return kept

    def _finished(self, request: Any, params: dict[str, Any] | None) -> dict[str, Any] | None:
        self._restores.pop(request.request_id, None)
        return super()._finished(request, mark_reply(request.kv_transfer_params, params))

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        # before the forward, in its stream's order (vLLM's KVConnectorModelRunnerMixin, 0.26 and 0.32)
        self._kept_states = [(tensor, block, tensor[block].clone())
                             for group, block in getattr(connector_metadata, "pdserve_kept_states", ())
                             for tensor in self._layers.get(group, ())]

    def wait_for_save(self) -> None:
        for tensor, block, kept in self._kept_states:  # after the forward: the blocks as they were before it
            tensor[block].copy_(kept)
        self._kept_states = []
        super().wait_for_save()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self.connector_worker
        if worker is not None and worker.use_host_buffer and worker._has_mamba:
            _stage_through_mirror(worker)
        self._layers = cache_views(kv_caches, self._kv_cache_config)
        super().register_kv_caches(kv_caches)


def _attention_block_sizes(kv_cache_config: Any) -> dict[int, int]:
    """The KV cache groups of attention layers, and their tokens per block."""
    return {index: group.kv_cache_spec.block_size for index, group in enumerate(kv_cache_config.kv_cache_groups)
            if not isinstance(group.kv_cache_spec, MambaSpec)}


def _state_groups(kv_cache_config: Any) -> list[int]:
    """The KV cache groups of recurrent layers."""
    return [index for index, group in enumerate(kv_cache_config.kv_cache_groups)
            if isinstance(group.kv_cache_spec, MambaSpec)]


def _cached_state_block_size(kv_cache_config: Any) -> int | None:
    """Tokens per cached recurrent state where vLLM caches them by block (align mode), else None."""
    sizes = [kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
             for group in _state_groups(kv_cache_config)
             if kv_cache_config.kv_cache_groups[group].kv_cache_spec.mamba_cache_mode != "none"]
    return min(sizes) if sizes else None
