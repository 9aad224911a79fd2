"""Runs inside every engine of a hybrid model (attention and Mamba-style layers), loaded as its KV connector module
(``kv_connector_module_path``): vLLM's NixlConnector (with pdserve's NIXL progress pause, nixl_progress.py) that

- keeps a prefill request's whole prompt where the request asks (whole_prompt.py says which and why), so its
  sampled token can be the client's first token (pdserve/pd/first_token.py);
- or, where a chat's prefill asks, samples that token after the whole prompt in a second step and hands over the
  recurrent state from before it (state_before_last.py): the scheduler side plans the steps and names the state
  blocks in its metadata; the worker side copies them before that step's forward (``bind_connector_metadata``)
  and writes them back after it (``wait_for_save``); new prompts wait out that second step (``_hold_new_prompts``),
  which would otherwise carry their whole prefill and keep the client's first token waiting as long;
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
from vllm.v1.kv_cache_interface import MambaSpec

from pdserve_vllm import FIRST_TOKEN_ARG, FIRST_TOKEN_PROCESSOR
from pdserve_vllm import state_before_last as before_last
from pdserve_vllm.first_token import FirstTokenProcessor
from pdserve_vllm.host_mirror import HostMirror, mirror_on_host
from pdserve_vllm.nixl_progress import NixlConnector as ProgressNixlConnector
from pdserve_vllm.whole_prompt import TRUNCATED_GUARD, keep_whole_prompt, keeps_whole_prompt, mark_reply

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
        self._kv_cache_config, self._vllm_config = kv_cache_config, vllm_config
        self._dropped: dict[str, int] = {}  # request id -> its last prompt token, while vLLM may drop it
        self._plans: dict[str, before_last.Plan] = {}
        self._state_layers: dict[int, list[torch.Tensor]] = {}  # recurrent group -> its layers' state tensors
        self._kept_states: list[tuple[torch.Tensor, int, torch.Tensor]] = []  # (tensor, block, copy) over a step
        self._hold_new_prompts = False  # a planned request's second step is next: it runs alone
        scheduler = self.connector_scheduler
        if scheduler is not None and scheduler._has_mamba and prefill_backoff(scheduler) != 1:
            log.warning("pdserve: this NixlConnector keeps %s prompt tokens off a prefill engine, not one: every "
                        "prefill stops short and its token is not the client's first", prefill_backoff(scheduler))

    def on_new_request(self, request: Any) -> None:
        scheduler = self.connector_scheduler
        if scheduler is not None and keeps_whole_prompt(
                request.kv_transfer_params, has_mamba=scheduler._has_mamba, backoff=prefill_backoff(scheduler)):
            keep_whole_prompt(request.kv_transfer_params)
        elif scheduler is not None and request.prompt_token_ids and before_last.asks_state_before_last(
                request.kv_transfer_params, has_mamba=scheduler._has_mamba,
                backoff=prefill_backoff(scheduler)) and _can_plan(scheduler, self._vllm_config):
            self._dropped[request.request_id] = request.prompt_token_ids[-1]
        super().on_new_request(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        # vLLM has truncated the prompt by now: 0.32 in on_new_request, 0.26 in get_num_new_matched_tokens
        token = self._dropped.pop(request.request_id, None)
        if token is not None:
            self._plan(request, token, blocks.get_block_ids())
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _plan(self, request: Any, token: int, block_ids: before_last.BlockIds) -> None:
        params, sampling = request.kv_transfer_params, request.sampling_params
        stop_token_ids = {*(sampling.stop_token_ids or ()), *([sampling.eos_token_id] if
                                                                sampling.eos_token_id is not None else [])}
        if not (params.get(TRUNCATED_GUARD) and request.max_tokens == 1 and before_last.dropped_token_may_lead(
                token, stop_token_ids=stop_token_ids, num_prompt_tokens=request.num_prompt_tokens + 1,
                state_block_size=_cached_state_block_size(self._kv_cache_config))):
            return
        plan = before_last.Plan(prompt_tokens=request.num_prompt_tokens, dropped_token=token)
        plan.allocated(block_ids)
        self._plans[request.request_id] = plan
        request.max_tokens = 2
        sampling.extra_args = {**(sampling.extra_args or {}), FIRST_TOKEN_ARG: token}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._hold_new_prompts:
            return None, False  # vLLM's "not known yet": the prompt waits one step, untouched
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        # vLLM hands its metadata object to the workers as it is (pickled): one attribute more rides along
        meta.pdserve_kept_states = self._kept_over(scheduler_output)  # type: ignore[attr-defined]
        return meta

    def _kept_over(self, scheduler_output: Any) -> list[tuple[int, int]]:
        """The (group, block) pairs whose state the workers keep over this step; and whether the next step holds new
        prompts back: where a planned request's first step ended in this one, its second (one token, a decode
        batch's CUDA graph) is next, and a prompt batched with it would make it as long as that prompt's prefill.
        The hold lasts one step whatever happens to the request, so nothing waits on it for longer."""
        prefilled = {req_id for req_id, plan in self._plans.items() if plan.prefill_done}
        kept = [pair for req_id, plan in self._plans.items() for pair in self._scheduled(req_id, plan, scheduler_output)]
        self._hold_new_prompts = any(plan.prefill_done and req_id not in prefilled for req_id, plan in self._plans.items())
        return kept

    def _scheduled(self, req_id: str, plan: before_last.Plan, output: Any) -> list[tuple[int, int]]:
        num_scheduled = output.num_scheduled_tokens.get(req_id)
        if not num_scheduled:
            return []
        new_blocks, resumed, computed = None, False, plan.prompt_tokens
        for new in output.scheduled_new_reqs:
            if new.req_id == req_id:
                computed = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        if req_id in cached.req_ids:
            index = cached.req_ids.index(req_id)
            new_blocks, computed = cached.new_block_ids[index], cached.num_computed_tokens[index]
            resumed = req_id in cached.resumed_req_ids
        return plan.scheduled(num_computed_tokens=computed, num_scheduled_tokens=num_scheduled,
                              new_block_ids=new_blocks, resumed=resumed,
                              state_groups=_state_groups(self._kv_cache_config))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)
        return delay_free, self._mark(request, mark_reply(request.kv_transfer_params, params))

    def request_finished_all_groups(  # vLLM's scheduler calls this one for a hybrid (SupportsHMA)
            self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished_all_groups(request, block_ids)
        return delay_free, self._mark(request, mark_reply(request.kv_transfer_params, params))

    def _mark(self, request: Any, params: dict[str, Any] | None) -> dict[str, Any] | None:
        self._dropped.pop(request.request_id, None)
        plan = self._plans.pop(request.request_id, None)
        if plan is None or self.connector_scheduler is None:
            return params
        plan.finished(list(request.output_token_ids))
        return before_last.mark_reply(plan, params, _clipped(self.connector_scheduler, plan.step_one_blocks))

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        # before the forward, in its stream's order (vLLM's KVConnectorModelRunnerMixin, 0.26 and 0.32)
        self._kept_states = [(tensor, block, tensor[block].clone())
                             for group, block in getattr(connector_metadata, "pdserve_kept_states", ())
                             for tensor in self._state_layers.get(group, ())]

    def wait_for_save(self) -> None:
        for tensor, block, kept in self._kept_states:  # after the forward: the state after n - 1 again
            tensor[block].copy_(kept)
        self._kept_states = []
        super().wait_for_save()  # type: ignore[no-untyped-call]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self.connector_worker
        if worker is not None and worker.use_host_buffer and worker._has_mamba:
            _stage_through_mirror(worker)
        config = self._kv_cache_config
        self._state_layers = {group: [view for name in config.kv_cache_groups[group].layer_names if name in kv_caches
                                      for view in _state_views(kv_caches[name], page_size_bytes=spec.page_size_bytes,
                                                               num_blocks=config.num_blocks)]
                              for group in _state_groups(config)
                              for spec in [config.kv_cache_groups[group].kv_cache_spec]}
        super().register_kv_caches(kv_caches)


def _state_views(cache: Any, *, page_size_bytes: int, num_blocks: int) -> list[torch.Tensor]:
    """A recurrent layer's KV cache as tensors whose first index is the block: 0.32 gives one tensor whose block
    ``b`` (conv and SSM state) starts ``b * page_size_bytes`` after its start, as NIXL registers it (base_worker.py,
    register_kv_caches), seen here as one row of bytes per block; 0.26 a list of state tensors (conv, ssm)."""
    if isinstance(cache, list | tuple):
        return list(cache)
    storage = cache.untyped_storage()
    pages = torch.empty(0, dtype=torch.uint8, device=cache.device)
    return [pages.set_(storage, cache.data_ptr() - storage.data_ptr(), (num_blocks, page_size_bytes),
                       (page_size_bytes, 1))]


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


def _clipped(scheduler: Any, block_ids: before_last.BlockIds) -> before_last.BlockIds:
    """``block_ids`` clipped as vLLM's connector clips those it hands over (sliding windows; 0.32 also keeps a
    recurrent group's running state block only)."""
    if hasattr(scheduler, "get_exchange_clipped_blocks"):  # 0.32
        return tuple(scheduler.get_exchange_clipped_blocks(block_ids))
    return tuple(scheduler.get_sw_clipped_blocks(block_ids))  # 0.26


def _can_plan(scheduler: Any, vllm_config: Any) -> bool:
    """Whether the two steps of state_before_last.py fit this engine: it loads pdserve's logits processor (which
    forces x), has no sliding-window group (its blocks are clipped to a window's tail, not step 1's) and no
    speculative scratch slots beside the running state."""
    processors = vllm_config.model_config.logits_processors or ()  # as named, or the classes once loaded
    return (any(processor in (FIRST_TOKEN_PROCESSOR, FirstTokenProcessor) for processor in processors)
            and not any(scheduler.blocks_per_sw) and not any(getattr(scheduler, "_ssm_spec_blocks", None) or ()))
