"""Pure: an EngineSpec becomes the argv and environment of one vLLM OpenAI server. No I/O."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.config import EngineSpec, KVTransferSpec, ModelSpec
from pdserve.engines.model_layout import ModelLayout, engine_needs
from pdserve.role import Role

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # a CPU engine's cores
# The prefill engine only produces KV cache, the decode engine only consumes it.
KV_ROLES = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}


@dataclass(frozen=True, slots=True)
class EngineCommand:
    argv: list[str]
    env: dict[str, str]  # added to the parent's environment


def build_engine_command(
    spec: EngineSpec, *, model: ModelSpec, model_path: str, layout: ModelLayout, kv: KVTransferSpec, python: str,
    host: str, cpu_bind: str,
) -> EngineCommand:
    """argv + env for ``spec``. ``cpu_bind`` is VLLM_CPU_OMP_THREADS_BIND for CPU engines; ``layout`` (of the
    model at ``model_path``) adds what a hybrid or multimodal model needs. Raises ConfigError when the pool's
    settings cannot hand that model off.
    """
    pool = spec.pool
    needs = engine_needs(layout, spec)
    argv = [
        python, "-m", VLLM_SERVER_MODULE,
        "--model", model_path,
        "--served-model-name", model.served_name,
        "--host", host,
        "--port", str(spec.port),
        "--max-model-len", str(model.max_model_len),
        "--dtype", model.dtype,
        "--tensor-parallel-size", str(pool.tensor_parallel_size),
        "--kv-transfer-config", json.dumps(kv_transfer_config(spec, kv)),
        *_block_size_args(spec, kv),
        *needs.args,
        *pool.extra_args,
    ]
    env = {
        "PYTHONUNBUFFERED": "1",
        # The address other nodes reach this engine at: NIXL's side channel and vLLM's own.
        "VLLM_NIXL_SIDE_CHANNEL_HOST": spec.host,
        "VLLM_HOST_IP": spec.host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port),
        # UCX logs which transport it chose for each protocol: `pdserve verify` reads it back.
        "UCX_PROTO_INFO": "y",
    }
    if pool.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in spec.gpu_ids)
        # UCX disables cuda_ipc reads (vLLM's decode-side pull) when NVML reports no NVLink,
        # as on single-GPU VMs, and falls back to TCP at ~20 MB/s; see docs/transport.md.
        env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(pool.kv_cache_gib)
        env[CPU_BIND_ENV] = cpu_bind
    env.update(needs.env)
    env.update(pool.env)
    return EngineCommand(argv=argv, env=env)


# Each KV block of each layer is one NIXL descriptor, and posting descriptors, not moving bytes,
# dominated the handoff on an H200: 128-token blocks cut the decode engine's inter-token p99 under
# load from 49 to 14 ms and tripled its KV bandwidth (docs/transport.md).
GPU_BLOCK_SIZE = 128


def _block_size_args(spec: EngineSpec, kv: KVTransferSpec) -> list[str]:
    """``--block-size`` unless the engine's extra_args already set it."""
    if "--block-size" in spec.pool.extra_args:
        return []
    block_size = kv.block_size or (GPU_BLOCK_SIZE if spec.pool.device == "cuda" else None)
    return [] if block_size is None else ["--block-size", str(block_size)]


def kv_transfer_config(spec: EngineSpec, kv: KVTransferSpec) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for one engine: unique engine_id, role, buffer device."""
    buffer_device = kv.buffer_device if kv.buffer_device != "auto" else spec.pool.device
    return {
        "kv_connector": kv.connector,
        "kv_role": KV_ROLES[spec.role],
        "engine_id": spec.engine_id,
        "kv_buffer_device": buffer_device,
        "kv_connector_extra_config": {"backends": list(kv.backends)},
    }


def split_cpus(cpus: Sequence[int], parts: int) -> list[str]:
    """Give each of ``parts`` CPU engines its own cores (VLLM_CPU_OMP_THREADS_BIND syntax).

    Two engines fighting over the same cores run slower than each on half of them. With
    fewer cores than engines, every engine gets them all.
    """
    ordered = sorted(cpus)
    if parts <= 0:
        return []
    if len(ordered) < parts:
        return [",".join(map(str, ordered))] * parts
    share = len(ordered) // parts
    return [",".join(map(str, ordered[i * share : (i + 1) * share])) for i in range(parts)]
