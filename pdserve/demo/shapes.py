"""Model folders with a real architecture's shape and no weights, for GPU runs with ``--load-format dummy``.

A transport or serving benchmark needs the real shape (layers, KV heads and head size set the KV
bytes per token; hidden sizes set the compute per token) but not real weights: vLLM fills them
with random values. Writes config.json, a tokenizer and its config; never weights, never a download.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType

FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
_BYTES_PER_VALUE = {"bfloat16": 2, "float16": 2, "float32": 4}


class Shape(StrEnum):
    QWEN3_8B = "qwen3-8b"


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
CONFIGS: Mapping[Shape, Mapping[str, object]] = MappingProxyType({Shape.QWEN3_8B: MappingProxyType(_QWEN3_8B)})
_SPECIAL_TOKENS = {"bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>"}


def kv_bytes_per_token(shape: Shape) -> int:
    """KV cache bytes one token occupies in every layer (K and V, the config's dtype). Pure."""
    config = CONFIGS[shape]
    values = 2 * _int(config, "num_hidden_layers") * _int(config, "num_key_value_heads") * _int(config, "head_dim")
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
    _write_tokenizer(target_dir, config)
    return target_dir


def _write_tokenizer(target_dir: Path, config: Mapping[str, object]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers  # the demo extra; vLLM installs it too

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
    }
    (target_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1) + "\n", encoding="utf-8")


def _int(config: Mapping[str, object], field: str) -> int:
    value = config[field]
    assert isinstance(value, int), f"{field} must be an int in a shape's config"
    return value
