"""A KV cache seen block by block, and one position-sensitive digest per block over every layer's bytes of it. Torch
only; no vLLM, no NIXL: kv_integrity.py computes the digests on both engines of a handoff and compares them.

The digest is a wrapping int64 sum of the block's bytes read as 32-bit words, each times an odd weight of its place,
mixed layer after layer: a changed word, two words swapped, another block's bytes or a layer out of place change it.
Not cryptographic: the threat is a faulty engine or link, not a malicious one (docs/reliability.md).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch

LayerCache = torch.Tensor | Sequence[torch.Tensor]  # an attention layer's tensor, a recurrent layer's states (0.26)
_WEIGHT_MULTIPLIER = 0x9E3779B1  # Knuth's multiplicative hash constant: neighbouring places get unrelated weights
_LAYER_MIX = 1_000_003  # a prime: the same bytes in another layer give another digest


def state_views(cache: LayerCache, *, page_size_bytes: int, state_bytes: int, num_blocks: int) -> list[torch.Tensor]:
    """A recurrent layer's KV cache as tensors whose first index is the block: 0.32 gives one tensor whose block
    ``b`` starts ``b * page_size_bytes`` after its start, as NIXL registers it (base_worker.py, register_kv_caches),
    seen here as one row per block of its first ``state_bytes`` (conv and SSM state; vLLM pads a page to an attention
    page's size, and neither NIXL nor the model reads the padding, which holds whatever the page held before); 0.26 a
    list of state tensors (conv, ssm)."""
    if not isinstance(cache, torch.Tensor):
        return list(cache)
    storage = cache.untyped_storage()
    pages = torch.empty(0, dtype=torch.uint8, device=cache.device)
    return [pages.set_(storage, cache.data_ptr() - storage.data_ptr(), (num_blocks, state_bytes),
                       (page_size_bytes, 1))]


def attention_blocks(cache: torch.Tensor, *, num_blocks: int) -> torch.Tensor:
    """An attention layer's KV cache indexed by logical block. vLLM lays it out with blocks outermost in memory (the
    CPU backend's shape starts with them; a hybrid's is restrided so, 0.26 ``_update_hybrid_attention_mamba_layout``;
    0.32 ``allocate_kv_cache``), each as whole kernel blocks where its kernels take smaller ones, whatever the
    dimension's place in the shape. Raises ValueError on another layout."""
    block_dim = max(range(cache.dim()), key=cache.stride)
    if cache.shape[block_dim] % num_blocks:
        raise ValueError(f"pdserve: an attention KV cache of shape {tuple(cache.shape)} and strides {cache.stride()} "
                         f"has no dimension of {num_blocks} blocks outermost")
    moved = cache.movedim(block_dim, 0)
    return moved.view(num_blocks, -1, *moved.shape[1:])  # splitting one dimension: a view whatever its strides


def block_views(kv_caches: Mapping[str, LayerCache], *, groups: Mapping[int, Sequence[str]],
                state_pages: Mapping[int, tuple[int, int]], num_blocks: int) -> dict[int, list[torch.Tensor]]:
    """Each KV cache group's layers (``groups``: group -> layer names) as tensors indexed by logical block; a group in
    ``state_pages`` (its page size and the state bytes at its start) holds recurrent state, the others attention.
    Raises ValueError as ``attention_blocks`` does."""
    return {group: [view for name in names if name in kv_caches for view in (
        state_views(kv_caches[name], page_size_bytes=state_pages[group][0], state_bytes=state_pages[group][1],
                    num_blocks=num_blocks)
        if group in state_pages else [attention_blocks(_tensor(kv_caches[name]), num_blocks=num_blocks)])]
        for group, names in groups.items()}


def digest_blocks(views: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[int]:
    """One digest per block of ``block_ids`` over every view of ``views`` (one group's layers), on their device; one
    copy of those blocks per layer, no loop over bytes in Python."""
    if not views or not block_ids:
        return [0] * len(block_ids)
    device = views[0].device
    index = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    total = torch.zeros(len(block_ids), dtype=torch.int64, device=device)
    for view in views:
        words = _words(view.index_select(0, index))
        total = total * _LAYER_MIX + (words * _weights(words.shape[1], device)).sum(dim=1)
    return [int(value) for value in total.tolist()]


def _words(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks (first index) as rows of int64 values of their 32-bit words (bytes where a row is not whole words)."""
    raw = blocks.contiguous().view(blocks.shape[0], -1).view(torch.uint8)
    return (raw.view(torch.int32) if raw.shape[1] % 4 == 0 else raw).to(torch.int64)


@functools.lru_cache(maxsize=32)
def _weights(count: int, device: torch.device) -> torch.Tensor:
    """``count`` odd weights, one per place: made once per row length and device (every layer of a model has a few
    lengths), not again for each layer of each handoff. Only read (multiplied), never written."""
    places = torch.arange(count, dtype=torch.int64, device=device)
    return (places * _WEIGHT_MULTIPLIER) % (1 << 32) | 1


def _tensor(cache: LayerCache) -> torch.Tensor:
    if not isinstance(cache, torch.Tensor):
        raise ValueError("pdserve: an attention layer's KV cache is a list of tensors, not one")  # noqa: TRY004 (a layout)
    return cache
