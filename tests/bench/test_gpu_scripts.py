"""The GPU scripts' dry path on CPU: `bench/gpu/pd_config.sh` writes a model folder and a config that load.

The GPU runs themselves need the H200 machine; what they share, the model shape and the config every
script starts from, runs here through pdserve's own commands (`demo-model --shape`, `config validate`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.config import load_settings
from pdserve.engines.model_layout import Layout, read_layout
from pdserve.role import Role

REPO = Path(__file__).parents[2]


def source_pd_config(tmp_path: Path, *, shape: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Source pd_config.sh as the GPU scripts do, with this venv's python3 first on PATH, writing under tmp_path."""
    variables = {"SHAPE": shape, "MODEL_DIR": str(tmp_path / shape), "CONFIG": str(tmp_path / "pd.yaml"),
                 "LOG_DIR": str(tmp_path / "logs"), **env}
    return subprocess.run(
        ["bash", "-c", "source bench/gpu/pd_config.sh"], check=False, cwd=REPO, capture_output=True, text=True,
        timeout=120,
        env={**os.environ, **variables, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )


def write_gpu_config(tmp_path: Path, *, shape: str, **env: str) -> Path:
    """The config pd_config.sh wrote and validated."""
    result = source_pd_config(tmp_path, shape=shape, **env)
    config = tmp_path / "pd.yaml"
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{config}: valid" in result.stdout
    return config


def test_qwen3_8b_config_serves_the_shape_with_dummy_weights_on_two_gpus(tmp_path: Path) -> None:
    settings = load_settings(write_gpu_config(tmp_path, shape="qwen3-8b", PREFILL_GPU="0", DECODE_GPU="1"))

    model_config = json.loads((tmp_path / "qwen3-8b" / "config.json").read_text())
    assert (model_config["hidden_size"], model_config["num_hidden_layers"]) == (4096, 36)
    assert settings.model.path == str(tmp_path / "qwen3-8b")
    specs = {spec.role: spec for spec in settings.engine_specs()}
    assert (specs[Role.PREFILL].gpu_ids, specs[Role.DECODE].gpu_ids) == ([0], [1])
    for spec in specs.values():
        args = spec.pool.extra_args
        assert spec.pool.device == "cuda" and args[args.index("--load-format") + 1] == "dummy"


@pytest.mark.parametrize(("bad", "field"), [({"MPS": "sometimes"}, "launch.mps"),
                                           ({"KV_BUFFER": "disk"}, "kv.buffer_device")])
def test_a_bad_setting_fails_naming_its_field_before_any_engine_would_start(
    tmp_path: Path, bad: dict[str, str], field: str
) -> None:
    result = source_pd_config(tmp_path, shape="qwen3-8b", **bad)

    assert result.returncode != 0
    assert f"{field}:" in result.stdout + result.stderr


def test_qwen3_5_9b_config_is_read_as_a_hybrid_model(tmp_path: Path) -> None:
    settings = load_settings(write_gpu_config(tmp_path, shape="qwen3.5-9b"))

    assert settings.model.path is not None
    assert read_layout(settings.model.path).layout is Layout.HYBRID


def test_verify_h200s_broken_path_is_host_staging_over_tcp_and_cross_layer_is_a_typed_setting(tmp_path: Path) -> None:
    broken = load_settings(write_gpu_config(tmp_path, shape="qwen3-8b", KV_BUFFER="cpu", CROSS_LAYER="off",
                                            ENGINE_ENV='{UCX_TLS: "tcp,self"}'))
    assert broken.kv.buffer_device == "cpu" and broken.kv.cross_layer_blocks == "off"
    assert broken.decode.env == {"UCX_TLS": "tcp,self"}
    assert load_settings(write_gpu_config(tmp_path, shape="qwen3-8b")).kv.cross_layer_blocks == "auto"


def test_the_decode_pool_alone_can_run_at_mps_below_normal_priority(tmp_path: Path) -> None:
    settings = load_settings(write_gpu_config(tmp_path, shape="qwen3-8b", DECODE_ENV='{CUDA_MPS_CLIENT_PRIORITY: "1"}'))
    assert settings.decode.env == {"CUDA_MPS_CLIENT_PRIORITY": "1"} and settings.prefill.env == {}


def test_the_machine_record_appends_the_load_and_the_cpu_model_at_each_call(tmp_path: Path) -> None:
    """bench/gpu/machine.sh as the GPU scripts source it, at a run's start and end (on a machine without a card the
    record says that nvidia-smi is missing)."""
    record = tmp_path / "machine.txt"
    subprocess.run(["bash", "-c", f"source bench/gpu/machine.sh; machine {record}; machine {record}"], check=True,
                   cwd=REPO, timeout=60)
    text = record.read_text()
    assert text.count("load average") == 2 and text.count("Model name") == 2, text
