"""A GPU engine's KV cache mirrored in host memory page by page, for a hybrid model (attention and
Mamba-style layers) whose KV is staged there (``kv_buffer_device: cpu``). Torch only; no vLLM, no NIXL.

vLLM 0.26's NixlConnector builds its host buffer from each layer's ``kv_cache.shape`` and copies blocks by
indexing dim 0 (``kv_connector/v1/nixl/base_worker.py`` ``initialize_host_xfer_buffer``;
``kv_connector/utils.py`` ``copy_kv_blocks``). A hybrid's layers share raw storages (the hybrid allocator
pools one tensor per layer of each group), its Mamba layers hold a list of state tensors, and its
attention views are made blocks-first by striding (``gpu_model_runner._update_hybrid_attention_mamba_layout``),
so neither holds. What does hold: each raw storage is ``num_blocks`` pages of equal size, and page ``b``
of every storage holds block ``b`` of whichever layer owns it. So the host copy repeats every storage byte
for byte, the layers' host views repeat their device views' offsets, shapes and strides, and a block moves
as that page of every storage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

LayerCache = torch.Tensor | Sequence[torch.Tensor]  # an attention layer's tensor, a Mamba layer's states


@dataclass(frozen=True, slots=True)
class PagedStorage:
    """One raw KV storage seen as (pages, page bytes), on the device and in its host copy."""

    device: torch.Tensor
    host: torch.Tensor


@dataclass(frozen=True, slots=True)
class HostMirror:
    """The layers' host views (what NIXL registers and moves) and the storages they live in."""

    views: dict[str, LayerCache]
    storages: tuple[PagedStorage, ...]

    def copy_pages(self, page_ids: Iterable[int], *, to_host: bool) -> None:
        """Copy pages ``page_ids`` of every storage to host memory (``to_host``) or back to the device."""
        ids = sorted(set(page_ids))
        if not ids:
            return
        for storage in self.storages:
            host_index = torch.tensor(ids, dtype=torch.long)
            device_index = host_index.to(storage.device.device)
            if to_host:
                storage.host[host_index] = storage.device[device_index].cpu()
            else:
                storage.device[device_index] = storage.host[host_index].to(storage.device.device)


def mirror_on_host(kv_caches: dict[str, LayerCache], *, num_pages: int) -> HostMirror:
    """A host copy of every raw storage under ``kv_caches`` (pinned where CUDA is present) and each layer's
    view of it. Raises ValueError when a storage is not ``num_pages`` pages of equal size."""
    hosts: dict[int, torch.Tensor] = {}  # device storage address -> its host bytes
    storages: list[PagedStorage] = []

    def host_view(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address not in hosts:
            if storage.nbytes() % num_pages:
                raise ValueError(f"a KV storage of {storage.nbytes()} bytes is not {num_pages} equal pages")
            hosts[address] = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            device_bytes = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            storages.append(PagedStorage(device=device_bytes.view(num_pages, -1), host=hosts[address].view(num_pages, -1)))
        return torch.empty(0, dtype=tensor.dtype).set_(
            hosts[address].untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())

    views: dict[str, LayerCache] = {
        name: host_view(cache) if isinstance(cache, torch.Tensor) else [host_view(state) for state in cache]
        for name, cache in kv_caches.items()
    }
    return HostMirror(views=views, storages=tuple(storages))
