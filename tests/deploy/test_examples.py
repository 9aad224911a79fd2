"""Every file in examples/ is a valid configuration, as `pdserve config validate` checks it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.config import load_settings
from pdserve.demo.shapes import CONFIGS, Shape
from pdserve.deploy.refusals import cluster_refusals
from pdserve.engines.command import build_engine_command
from pdserve.engines.kv_link import HostLink
from pdserve.engines.model_layout import detect_layout

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


def test_the_examples_are_there() -> None:
    assert {"eks-g6-efa.yaml", "laptop.yaml", "reference-one-gpu.yaml", "two-gpus.yaml"} <= {
        path.name for path in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_example_loads(path: Path) -> None:
    load_settings(path)


def test_config_validate_refuses_the_eks_example_until_its_account_placeholder_is_replaced() -> None:
    """`cloud up` refuses the placeholder before anything is created; `config validate` says so first."""
    examples = Path(__file__).parents[2] / "examples"
    settings = load_settings(examples / "eks-g6-efa.yaml")
    assert [problem for problem in cluster_refusals(settings) if "<account> is a placeholder" in problem]
    image = "123456789012.dkr.ecr.us-west-2.amazonaws.com/pdserve:0.1.0"
    pushed = settings.model_copy(update={"kubernetes": settings.kubernetes.model_copy(update={"image": image})})
    assert cluster_refusals(pushed) == []


def test_laptop_example_is_the_defaults() -> None:
    examples = Path(__file__).parents[2] / "examples"
    laptop = load_settings(examples / "laptop.yaml")
    assert laptop == load_settings(None)


def test_two_gpus_example_puts_prefill_and_decode_on_their_own_gpu() -> None:
    settings = load_settings(Path(__file__).parents[2] / "examples" / "two-gpus.yaml")
    assert [(spec.role.value, spec.gpu_ids) for spec in settings.engine_specs()] == [("prefill", [0]), ("decode", [1])]


def test_the_eks_example_serves_the_reference_deployments_model_with_its_settings_as_typed_fields() -> None:
    """The reference: Qwen/Qwen3.5-9B on each 24 GB L4, max_model_len 4096, eager, 0.90 of the GPU."""
    settings = load_settings(Path(__file__).parents[2] / "examples" / "eks-g6-efa.yaml")
    assert (settings.model.path, settings.model.max_model_len, settings.model.dtype) == ("Qwen/Qwen3.5-9B", 4096,
                                                                                          "bfloat16")
    for pool in (settings.prefill, settings.decode):
        assert (pool.gpu_memory_utilization, pool.enforce_eager, pool.extra_args) == (0.9, True, [])


def test_the_reference_one_gpu_example_mirrors_the_references_engines_on_gpu_0() -> None:
    """The reference's serveConfigV2 engine settings, both engines on one GPU, each held to what 0.90 of a
    24 GB L4 gives (23,034 MiB), KV staged in host memory as on a g6; the model settings the EKS example's."""
    examples = Path(__file__).parents[2] / "examples"
    settings = load_settings(examples / "reference-one-gpu.yaml")
    eks = load_settings(examples / "eks-g6-efa.yaml")
    assert settings.model == eks.model
    assert (settings.model.path, settings.model.served_name, settings.model.max_model_len, settings.model.dtype) == (
        "Qwen/Qwen3.5-9B", "qwen3.5-9b", 4096, "bfloat16")
    assert [(spec.role.value, spec.gpu_ids) for spec in settings.engine_specs()] == [("prefill", [0]), ("decode", [0])]
    h100_mib, l4_mib = 81_559, 23_034  # nvidia-smi's memory.total
    for pool in (settings.prefill, settings.decode):
        assert pool.enforce_eager and pool.device == "cuda" and pool.extra_args == []
        assert pool.gpu_memory_utilization is not None
        assert pool.gpu_memory_utilization * h100_mib <= 0.90 * l4_mib
    assert settings.prefill.gpu_memory_utilization + settings.decode.gpu_memory_utilization < 1  # type: ignore[operator]
    assert settings.kv.buffer_device == "cpu" and settings.kv.backends == ["UCX"]


def test_the_reference_one_gpu_example_plans_engine_commands_for_the_hybrid_model() -> None:
    settings = load_settings(Path(__file__).parents[2] / "examples" / "reference-one-gpu.yaml")
    layout = detect_layout(dict(CONFIGS[Shape.QWEN3_5_9B]), model="Qwen/Qwen3.5-9B")
    for spec in settings.engine_specs():
        command = build_engine_command(spec, model=settings.model, model_path="Qwen/Qwen3.5-9B", layout=layout,
                                       kv=settings.kv, python="py", host="127.0.0.1", cpu_bind="", link=HostLink())
        argv = command.argv
        assert {"--enforce-eager", "--language-model-only"} <= set(argv)
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.25"
        assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_buffer_device"] == "cpu"
