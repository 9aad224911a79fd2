"""Pure: how many sequences a Gated DeltaNet model's KV cache holds at once, counted as vLLM counts its blocks,
and the ``--max-num-seqs`` that follows. No I/O.

A hybrid model's linear-attention layers keep one state block per sequence, in the same block pool as the
attention layers' KV. With decode CUDA graphs vLLM refuses to start when max_num_seqs exceeds the pool's
blocks ("max_num_seqs (1024) exceeds available Mamba cache blocks (614)", vllm/config/compilation.py,
resolve_cudagraph_mode_and_sizes), and its default max_num_seqs (1024 on GPUs of 70 GiB or more,
vllm/engine/arg_utils.py get_batch_defaults) ignores how much KV cache the engine was given.

vLLM 0.26's count, which this module follows:
- page: the attention block is raised until its page holds one layer's state: block = align x
  ceil(state / (align x attention bytes per token)), align = the engine's block size (vllm/platforms/
  interface.py, _align_hybrid_block_size); the state is padded up to that page.
- group size: layers of each kind are split into groups of the smaller kind's count (the larger's where it
  is under 1.5x the smaller); each group has its own block table (vllm/v1/core/kv_cache_utils.py,
  _get_kv_cache_groups_uniform_page_size).
- blocks = KV bytes // page // group size (get_kv_cache_config_from_groups, get_num_blocks).
- a running sequence holds at least one block in every group (one state block per linear group, one KV
  block per attention group), and block 0 is the pool's null block (vllm/v1/core/block_pool.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine_config import EngineSpec, PoolSpec
from pdserve.engines.host_checks import VLLM_GPU_MEMORY_UTILIZATION
from pdserve.engines.model_layout import RecurrentShape
from pdserve.errors import ConfigError

GIB = 1 << 30
MAX_NUM_SEQS_FLAG = "--max-num-seqs"
KV_CACHE_BYTES_FLAG = "--kv-cache-memory-bytes"
ENFORCE_EAGER_FLAG = "--enforce-eager"
# Flags that change the cache's dtypes or grouping in ways not modelled here: pdserve then sizes nothing.
UNMODELLED_FLAGS = ("--kv-cache-dtype", "--mamba-cache-dtype", "--mamba-ssm-cache-dtype", "--speculative-config",
                    "--enable-prefix-caching", "--mamba-block-size")
# vLLM's largest default max_num_seqs: GPUs of 70 GiB or more get 1024, smaller ones 256, CPU engines
# 128 x tensor_parallel_size (vllm/engine/arg_utils.py, get_batch_defaults, OPENAI_API_SERVER).
GPU_DEFAULT_MAX_NUM_SEQS = 1024
CPU_DEFAULT_MAX_NUM_SEQS_PER_WORKER = 128
BYTES_PER_VALUE = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass(frozen=True, slots=True)
class BlockCount:
    """One engine's KV cache as vLLM will divide it."""

    kv_cache_bytes: int
    page_bytes: int  # one block of one layer: the attention block padded to hold a state, or the state
    block_tokens: int  # attention tokens per block
    layers_per_group: int
    groups: int
    blocks: int  # vLLM's num_blocks, what its Mamba check compares max_num_seqs against

    @property
    def sequences(self) -> int:
        """The most sequences resident at once: one block in every group each, less the null block."""
        return max(0, (self.blocks - 1) // self.groups)

    def describe(self) -> str:
        return (f"{self.kv_cache_bytes / GIB:.1f} GiB of KV cache holds {self.blocks} blocks "
                f"({self.page_bytes:,} bytes a layer, {self.block_tokens} tokens; {self.groups} groups of "
                f"{self.layers_per_group} layers), {self.sequences} sequences at once")


def count_blocks(shape: RecurrentShape, *, kv_cache_bytes: int, dtype: str, block_size: int,
                 tensor_parallel_size: int = 1) -> BlockCount:
    """vLLM's block count for ``shape`` served in ``dtype`` (model.dtype; auto = the config's) with
    ``block_size`` tokens per attention block, ``kv_cache_bytes`` per GPU (or CPU engine), each of
    ``tensor_parallel_size`` workers holding its share of the heads."""
    model_bytes = BYTES_PER_VALUE[shape.config_dtype if dtype == "auto" else dtype]
    state_bytes = (shape.conv_values * model_bytes
                   + shape.temporal_values * BYTES_PER_VALUE.get(shape.temporal_dtype, model_bytes)) // tensor_parallel_size
    kv_heads_here = max(1, shape.kv_heads // tensor_parallel_size)
    token_bytes = shape.attention_token_values // shape.kv_heads * kv_heads_here * model_bytes
    block_tokens = max(block_size, block_size * -(-state_bytes // (block_size * token_bytes)))
    page_bytes = block_tokens * token_bytes
    smaller, larger = sorted((shape.linear_layers, shape.attention_layers))
    per_group = larger if larger < smaller * 1.5 else smaller
    groups = -(-shape.linear_layers // per_group) + -(-shape.attention_layers // per_group)
    return BlockCount(kv_cache_bytes=kv_cache_bytes, page_bytes=page_bytes, block_tokens=block_tokens,
                      layers_per_group=per_group, groups=groups, blocks=kv_cache_bytes // page_bytes // per_group)


def default_max_num_seqs(*, device: str, tensor_parallel_size: int) -> int:
    """vLLM's largest default max_num_seqs on ``device``: what pdserve's own value never exceeds."""
    return GPU_DEFAULT_MAX_NUM_SEQS if device == "cuda" else CPU_DEFAULT_MAX_NUM_SEQS_PER_WORKER * tensor_parallel_size


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag value`` or ``--flag=value``); None when absent."""
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


def parse_size(text: str) -> int | None:
    """A byte count as vLLM's flags take it: ``12884901888``, ``12G`` (GiB) or ``12g`` (10^9); None if neither."""
    multipliers = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    text = text.strip()
    if text.isdigit():
        return int(text)
    if text[:-1].replace(".", "", 1).isdigit() and text[-1:] in multipliers:
        return int(float(text[:-1]) * multipliers[text[-1]])
    return None


def pool_kv_cache_bytes(pool: PoolSpec, *, gpu_memory_bytes: int | None, weight_bytes: int | None) -> int | None:
    """The KV cache one engine of ``pool`` gets: a CPU engine's kv_cache_gib, a GPU engine's
    --kv-cache-memory-bytes; else at most its share of the GPU (gpu_memory_utilization, vLLM's 0.9 by
    default, of ``gpu_memory_bytes``) less its share of the weights (``weight_bytes`` over the tensor-parallel
    workers): vLLM also takes activations and CUDA graphs from it. None where a figure is unknown."""
    if pool.device == "cpu":
        return pool.kv_cache_gib * GIB
    given = flag_value(pool.extra_args, KV_CACHE_BYTES_FLAG)
    if given is not None:
        return parse_size(given)
    if gpu_memory_bytes is None or weight_bytes is None:
        return None
    share = pool.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
    left = int(share * gpu_memory_bytes) - weight_bytes // pool.tensor_parallel_size
    return left if left > 0 else None


def max_num_seqs_args(spec: EngineSpec, *, shape: RecurrentShape | None, model: str, dtype: str, block_size: int,
                      gpu_memory_bytes: int | None = None, weight_bytes: int | None = None) -> tuple[list[str], str]:
    """(``--max-num-seqs N`` where pdserve sets it, a note on why), for ``spec``'s engine of ``model``.

    The pool's max_num_seqs (or the flag in extra_args) is kept. Otherwise a Gated DeltaNet model whose
    KV cache size pdserve knows (``pool_kv_cache_bytes``) gets the sequences that cache holds at once, where
    that is below vLLM's default; one block per group and sequence also leaves room, where the size is a GPU
    share less the weights, for what vLLM takes besides the cache. Raises ConfigError, where the size is
    exact, when the cache holds no sequence or the pool's value would fail vLLM's start-up check."""
    pool = spec.pool
    in_args = flag_value(pool.extra_args, MAX_NUM_SEQS_FLAG)
    if in_args is not None and not in_args.isdigit():
        return [], ""  # vLLM says what it makes of it
    asked = int(in_args) if in_args is not None else pool.max_num_seqs
    own = [MAX_NUM_SEQS_FLAG, str(asked)] if asked is not None and in_args is None else []
    count, is_exact = _block_count(pool, shape=shape, dtype=dtype, block_size=block_size,
                                   gpu_memory_bytes=gpu_memory_bytes, weight_bytes=weight_bytes)
    if count is None:
        return own, ""
    if is_exact:
        _refuse_what_cannot_start(spec, count, asked=asked, model=model)
    if asked is not None or count.sequences < 1:
        return own, ""
    if count.sequences >= default_max_num_seqs(device=pool.device, tensor_parallel_size=pool.tensor_parallel_size):
        return [], ""
    return [MAX_NUM_SEQS_FLAG, str(count.sequences)], f"max_num_seqs {count.sequences}: {count.describe()}"


def _block_count(pool: PoolSpec, *, shape: RecurrentShape | None, dtype: str, block_size: int,
                 gpu_memory_bytes: int | None, weight_bytes: int | None) -> tuple[BlockCount | None, bool]:
    """(the pool's block count, whether its KV size is exact) or (None, False) where it cannot be counted. A GPU
    share less the checkpoint is an estimate (a multimodal checkpoint counts a tower vLLM does not load): good
    for a batch size, not for refusing a configuration."""
    kv_cache_bytes = pool_kv_cache_bytes(pool, gpu_memory_bytes=gpu_memory_bytes, weight_bytes=weight_bytes)
    unmodelled = any(flag in pool.extra_args or flag_value(pool.extra_args, flag) for flag in UNMODELLED_FLAGS)
    if shape is None or kv_cache_bytes is None or unmodelled:
        return None, False
    count = count_blocks(shape, kv_cache_bytes=kv_cache_bytes, dtype=dtype, block_size=block_size,
                         tensor_parallel_size=pool.tensor_parallel_size)
    return count, pool_kv_cache_bytes(pool, gpu_memory_bytes=None, weight_bytes=None) is not None


def _refuse_what_cannot_start(spec: EngineSpec, count: BlockCount, *, asked: int | None, model: str) -> None:
    role = spec.role.value
    if count.sequences < 1:
        raise ConfigError(f"{role}: {count.describe()} of model {model}: not one sequence fits; give the engine more "
                          "KV cache (kv_cache_gib on CPU, --kv-cache-memory-bytes on GPU)")
    if asked is not None and asked > count.blocks and captures_cuda_graphs(spec.pool):
        raise ConfigError(
            f"{role}.max_num_seqs is {asked}, but {count.describe()} of model {model}, and with decode CUDA "
            f"graphs vLLM refuses to start with more sequences than blocks (\"max_num_seqs ({asked}) exceeds "
            f"available Mamba cache blocks ({count.blocks})\"): set max_num_seqs to at most {count.blocks} "
            f"({count.sequences} run at once), give the engine more KV cache, or set enforce_eager")


def captures_cuda_graphs(pool: PoolSpec) -> bool:
    """Whether vLLM captures decode CUDA graphs for this pool's engines (a hybrid model's default)."""
    return pool.device == "cuda" and not pool.enforce_eager and ENFORCE_EAGER_FLAG not in pool.extra_args
