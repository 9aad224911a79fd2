"""A hybrid model's KV mirrored in host memory (pdserve_vllm/host_mirror.py), on a layout built as vLLM
builds a hybrid's: raw storages each shared by an attention layer (blocks-first by striding) and a Mamba
layer (conv and SSM states at offsets inside each page)."""

from __future__ import annotations

import torch

from pdserve_vllm.host_mirror import mirror_on_host

NUM_BLOCKS, PAGE_BYTES = 6, 512


def hybrid_layers(raw: torch.Tensor, index: int) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """One attention and one Mamba layer sharing ``raw``, as vLLM's hybrid allocator pools them."""
    bf16, fp32 = raw.view(torch.bfloat16), raw.view(torch.float32)
    page_bf16, page_fp32 = PAGE_BYTES // 2, PAGE_BYTES // 4
    # (2, blocks, block_size 8, heads 2, head 8) with K and V of one block next to each other
    attention = bf16.as_strided((2, NUM_BLOCKS, 8, 2, 8), (page_bf16 // 2, page_bf16, 16, 8, 1))
    conv = bf16.as_strided((NUM_BLOCKS, 3, 10), (page_bf16, 10, 1))  # 60 bytes from a page's start
    ssm = fp32.as_strided((NUM_BLOCKS, 2, 8, 4), (page_fp32, 32, 4, 1), 60 // 4)
    return {f"attn.{index}": attention, f"mamba.{index}": [conv, ssm]}


def blocks(cache: torch.Tensor | list[torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    """The bytes of blocks ``ids`` in a layer's view(s), whatever dim holds its blocks (bytes: random bits
    make NaNs, which never compare equal)."""
    states = [cache] if isinstance(cache, torch.Tensor) else cache
    picked = [state[:, ids] if state.dim() == 5 else state[ids] for state in states]
    return [state.contiguous().view(torch.uint8) for state in picked]


def test_pages_copied_out_and_back_hold_every_layers_blocks() -> None:
    raws = [torch.randint(0, 255, (NUM_BLOCKS * PAGE_BYTES,), dtype=torch.uint8) for _ in range(2)]
    kv_caches = {**hybrid_layers(raws[0], 0), **hybrid_layers(raws[1], 1)}
    mirror = mirror_on_host(kv_caches, num_pages=NUM_BLOCKS)
    assert len(mirror.storages) == 2  # two layers per storage, one host copy each

    mirror.copy_pages([4, 1], to_host=True)
    for name, cache in kv_caches.items():
        for device, host in zip(blocks(cache, [1, 4]), blocks(mirror.views[name], [1, 4]), strict=True):
            assert torch.equal(device, host), name

    saved = {name: [state.clone() for state in blocks(cache, [1, 4])] for name, cache in kv_caches.items()}
    for raw in raws:
        raw.zero_()
    mirror.copy_pages([1, 4], to_host=False)
    for name, cache in kv_caches.items():
        assert all(torch.equal(a, b) for a, b in zip(blocks(cache, [1, 4]), saved[name], strict=True)), name
        assert all(not state.any() for state in blocks(cache, [0, 2, 3, 5])), name  # other pages untouched


def test_a_storage_that_is_not_whole_pages_is_refused() -> None:
    raw = torch.zeros(NUM_BLOCKS * PAGE_BYTES + 1, dtype=torch.uint8)
    try:
        mirror_on_host({"attn.0": raw.view(-1)}, num_pages=NUM_BLOCKS)
    except ValueError as exc:
        assert "not 6 equal pages" in str(exc)
    else:
        raise AssertionError("a storage of uneven pages was mirrored")
