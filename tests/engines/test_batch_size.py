"""A hybrid model sizes its own batch: `--max-num-seqs` from the blocks its KV cache holds, as vLLM counts
them (engines/batch_size.py), so a capped or small GPU starts; a pool's own value is kept, or refused with
the numbers where vLLM would refuse to start."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pdserve.config import parse_settings
from pdserve.demo.shapes import CONFIGS, Shape
from pdserve.engines.batch_size import count_blocks
from pdserve.engines.command import build_engine_command
from pdserve.engines.kv_link import HostLink
from pdserve.engines.model_layout import RecurrentShape, detect_layout, read_weight_bytes
from pdserve.errors import ConfigError

GIB = 1 << 30
QWEN3_5_9B = detect_layout(dict(CONFIGS[Shape.QWEN3_5_9B]), model="Qwen/Qwen3.5-9B")
TINY = detect_layout(dict(CONFIGS[Shape.QWEN3_NEXT_TINY]), model="tiny")


def qwen_shape() -> RecurrentShape:
    assert QWEN3_5_9B.recurrent is not None
    return QWEN3_5_9B.recurrent


def max_num_seqs(pool: dict[str, Any], *, layout: Any = QWEN3_5_9B, dtype: str = "bfloat16",
                 gpu_memory_bytes: int | None = None) -> str | None:
    """The --max-num-seqs the prefill engine gets (None: vLLM's default), for the pool settings ``pool``."""
    settings = parse_settings({"model": {"dtype": dtype}, "prefill": pool}, source="test")
    spec = settings.engine_specs()[0]
    argv = build_engine_command(spec, model=settings.model, model_path="/m", layout=layout, kv=settings.kv,
                                python="py", host="127.0.0.1", cpu_bind="0", link=HostLink(),
                                gpu_memory_bytes=gpu_memory_bytes).argv
    return argv[argv.index("--max-num-seqs") + 1] if "--max-num-seqs" in argv else None


def gpu_pool(kv_bytes: int, **pool: Any) -> dict[str, Any]:
    extra = ["--kv-cache-memory-bytes", str(kv_bytes), *pool.pop("extra_args", [])]
    return {"device": "cuda", "gpu_ids": [0], "extra_args": extra, **pool}


def test_qwen3_5_9b_blocks_are_the_614_vllm_reported_for_12_gib() -> None:
    # issue 41: "max_num_seqs (1024) exceeds available Mamba cache blocks (614)" with 12 GiB of KV, 128-token blocks.
    # A state is 24,576 bf16 conv values + 524,288 float32 temporal values = 2,146,304 bytes; an attention token
    # 2 x 4 x 256 x 2 = 4,096 bytes: blocks of 640 tokens (2,621,440 bytes); 24 linear + 8 attention layers make
    # 4 groups of 8, so 12 GiB // 2,621,440 // 8 = 614.
    count = count_blocks(qwen_shape(), kv_cache_bytes=12 * GIB, dtype="bfloat16", block_size=128)
    assert (count.block_tokens, count.page_bytes, count.layers_per_group, count.groups) == (640, 2_621_440, 8, 4)
    assert count.blocks == 614 and count.sequences == 153


def test_a_12_gib_engine_gets_max_num_seqs_it_holds_and_a_3_gib_one_a_quarter_of_it() -> None:
    twelve, three = (max_num_seqs(gpu_pool(gib * GIB)) for gib in (12, 3))
    assert twelve is not None and three is not None
    assert int(twelve) <= 614 and int(twelve) == 153
    assert int(three) == 38  # 153 blocks at 3 GiB: the same groups, a quarter of the memory
    # 256-token blocks align the page to 768 tokens (3,145,728 bytes): 512 blocks, 127 sequences
    assert max_num_seqs(gpu_pool(12 * GIB, extra_args=["--block-size", "256"])) == "127"


def test_what_is_not_hybrid_or_of_unknown_size_or_roomy_keeps_vllms_default() -> None:
    dense = detect_layout(dict(CONFIGS[Shape.QWEN3_8B]), model="q8b")
    assert max_num_seqs(gpu_pool(12 * GIB), layout=dense) is None
    assert max_num_seqs({"device": "cuda", "gpu_ids": [0], "gpu_memory_utilization": 0.9}) is None  # vLLM sizes it
    assert max_num_seqs(gpu_pool(96 * GIB)) is None  # 4915 blocks, 1228 sequences: vLLM's 1024 fits
    assert max_num_seqs({"kv_cache_gib": 1}, layout=TINY) is None  # the CPU demo: 2047 sequences, above 128


def test_a_pools_own_max_num_seqs_is_kept_or_refused_with_the_numbers() -> None:
    assert max_num_seqs(gpu_pool(12 * GIB, max_num_seqs=64)) == "64"
    assert max_num_seqs(gpu_pool(12 * GIB, max_num_seqs=1024, enforce_eager=True)) == "1024"  # no graphs, no check
    with pytest.raises(ConfigError) as refused:
        max_num_seqs(gpu_pool(12 * GIB, max_num_seqs=1024))
    message = str(refused.value)
    assert "prefill.max_num_seqs is 1024" in message and "614 blocks" in message and "12.0 GiB" in message
    with pytest.raises(ConfigError, match="614 blocks"):
        max_num_seqs(gpu_pool(12 * GIB, extra_args=["--max-num-seqs", "1000"]))


def test_a_cache_too_small_for_one_sequence_is_refused() -> None:
    with pytest.raises(ConfigError, match="not one sequence fits"):
        max_num_seqs(gpu_pool(30 * 2**20))


MIB = 1 << 20
TEXT_WEIGHTS = 17_900_000_000  # Qwen3.5-9B's bf16 text weights (docs/deploy.md, "Fit")


def test_a_gpu_share_bounds_the_kv_cache_by_the_gpus_memory_less_the_weights() -> None:
    """The reference on an L4: 0.90 x 23,034 MiB less 17.9 GB leaves at most 3.6 GiB: 182 blocks, 45 sequences,
    under the 256 vLLM defaults to there; the one-GPU example's 0.25 of an H100 (81,559 MiB) leaves 165, 41."""
    layout = replace(QWEN3_5_9B, weight_bytes=TEXT_WEIGHTS)
    pool = {"device": "cuda", "gpu_ids": [0], "gpu_memory_utilization": 0.9, "enforce_eager": True}
    assert max_num_seqs(pool, layout=layout, gpu_memory_bytes=23_034 * MIB) == "45"
    pool["gpu_memory_utilization"] = 0.25
    assert max_num_seqs(pool, layout=layout, gpu_memory_bytes=81_559 * MIB) == "41"
    assert max_num_seqs(pool, layout=layout) is None  # no GPU figure: vLLM's default
    assert max_num_seqs(pool, layout=QWEN3_5_9B, gpu_memory_bytes=81_559 * MIB) is None  # no weights figure (a shape)


def test_weight_bytes_come_from_the_safetensors_index_or_files(tmp_path: Path) -> None:
    assert read_weight_bytes(str(tmp_path)) is None  # a shape folder: config and tokenizer only
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 200)
    assert read_weight_bytes(str(tmp_path)) == 500
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 19_300_000_000}}))
    assert read_weight_bytes(str(tmp_path)) == 19_300_000_000
