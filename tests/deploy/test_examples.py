"""Every file in examples/ is a valid configuration, as `pdserve config validate` checks it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.config import load_settings

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


def test_the_examples_are_there() -> None:
    assert {"eks-g6-efa.yaml", "laptop.yaml", "two-gpus.yaml"} <= {path.name for path in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_example_loads(path: Path) -> None:
    load_settings(path)


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
