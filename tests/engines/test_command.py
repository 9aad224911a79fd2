from __future__ import annotations

import json

from pdserve.config import parse_settings
from pdserve.engines.command import build_engine_command, split_cpus
from pdserve.engines.model_layout import Layout, ModelLayout


def commands(tree: dict[str, object]) -> list[tuple[list[str], dict[str, str]]]:
    settings = parse_settings(tree, source="t")
    result = []
    for spec in settings.engine_specs():
        command = build_engine_command(spec, model=settings.model, model_path="/m", kv=settings.kv,
                                       layout=ModelLayout("/m", Layout.ATTENTION, "test"),
                                       python="py", host="127.0.0.1", cpu_bind="0")
        result.append((command.argv, command.env))
    return result


def test_cpu_engines_get_nixl_roles_ids_side_channels_and_cpu_buffer() -> None:
    (prefill_argv, prefill_env), (decode_argv, decode_env) = commands({})
    prefill_kv = json.loads(prefill_argv[prefill_argv.index("--kv-transfer-config") + 1])
    decode_kv = json.loads(decode_argv[decode_argv.index("--kv-transfer-config") + 1])
    assert (prefill_kv["kv_role"], decode_kv["kv_role"]) == ("kv_producer", "kv_consumer")
    assert prefill_kv["engine_id"] != decode_kv["engine_id"]
    assert prefill_kv["kv_buffer_device"] == decode_kv["kv_buffer_device"] == "cpu"
    assert prefill_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != decode_env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert prefill_env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "CUDA_VISIBLE_DEVICES" not in prefill_env
    assert prefill_argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]


def test_gpu_engines_are_pinned_and_read_over_cuda_ipc() -> None:
    tree = {"prefill": {"base_port": 8100, "device": "cuda", "gpu_ids": [0, 1], "tensor_parallel_size": 2},
            "decode": {"base_port": 8200, "device": "cuda", "gpu_ids": [2], "extra_args": ["--enforce-eager"]}}
    (prefill_argv, prefill_env), (decode_argv, decode_env) = commands(tree)
    assert prefill_env["CUDA_VISIBLE_DEVICES"] == "0,1" and decode_env["CUDA_VISIBLE_DEVICES"] == "2"
    assert prefill_argv[prefill_argv.index("--tensor-parallel-size") + 1] == "2"
    assert decode_env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    assert json.loads(decode_argv[decode_argv.index("--kv-transfer-config") + 1])["kv_buffer_device"] == "cuda"
    assert decode_argv[-1] == "--enforce-eager"


def test_gpu_engines_get_large_kv_blocks_unless_told_otherwise() -> None:
    def block_sizes(tree: dict[str, object]) -> list[str | None]:
        return [argv[argv.index("--block-size") + 1] if "--block-size" in argv else None
                for argv, _env in commands(tree)]

    gpu = {"device": "cuda", "gpu_ids": [0]}
    assert block_sizes({"prefill": gpu, "decode": gpu}) == ["128", "128"]
    assert block_sizes({}) == [None, None]  # CPU engines keep vLLM's default
    assert block_sizes({"prefill": gpu, "decode": gpu, "kv": {"block_size": 64}}) == ["64", "64"]
    own = {**gpu, "extra_args": ["--block-size", "32"]}
    assert block_sizes({"prefill": own, "decode": own}) == ["32", "32"]  # once, the user's


def test_split_cpus_gives_each_engine_its_own_cores() -> None:
    assert split_cpus([0, 1], 2) == ["0", "1"]
    assert split_cpus([0, 1, 2, 3, 4], 2) == ["0,1", "2,3"]
    assert split_cpus([3], 2) == ["3", "3"]
