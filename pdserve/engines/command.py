"""Pure: an EngineSpec becomes the argv and environment of one vLLM OpenAI server. No I/O."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import ENV_PREFIX
from pdserve.engine_config import EngineSpec, KVTransferSpec, ModelSpec, PoolSpec
from pdserve.engine_key import NO_ENGINE_KEY, EngineKey
from pdserve.engines.batch_size import flag_value, max_num_seqs_args
from pdserve.engines.cpu_affinity import parse_cpu_list
from pdserve.engines.kv_link import (
    BufferChoice,
    HostLink,
    choose_buffer_device,
    libfabric_env,
    libfabric_provider,
    transport_env,
)
from pdserve.engines.kv_path import BUFFER_NOTE, PROVIDER_NOTE
from pdserve.engines.model_layout import Layout, ModelLayout, engine_needs
from pdserve.errors import ConfigError
from pdserve.role import Role
from pdserve_vllm import ENGINE_KEY_MIDDLEWARE, FIRST_TOKEN_PROCESSOR, PROGRESS_DELAY_ENV, VLLM_SERVER_MODULE

# vLLM's server, whose engine core a CPU engine may fork instead of spawning (pdserve_vllm/engine_server.py).
CPU_SERVER_MODULE = "pdserve_vllm.engine_server"
# What the gateway and the supervisor poll, several times a second in all: left out of the engine's access log,
# which keeps every client request's line (vLLM's uvicorn filter matches these paths exactly:
# vllm/logging_utils/uvicorn_logging.py, UvicornAccessLogFilter).
POLLED_PATHS = ("/health", "/metrics")
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # a CPU engine's cores
OTLP_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
# Where vLLM keeps torch.compile's output (VLLM_CACHE_ROOT/torch_compile_cache); a start that finds it
# loads the compiled graphs instead of compiling for minutes.
COMPILE_CACHE_ENV = "VLLM_CACHE_ROOT"
DEFAULT_COMPILE_CACHE = "~/.cache/vllm"  # vLLM's own default (vllm/envs.py)
# vLLM's NixlConnector, loaded from pdserve's module that keys its handshake side channel with the engine key and
# makes its NIXL progress thread pause (where PROGRESS_DELAY_ENV says), or, for a hybrid model, from the one that
# also keeps a prefill's whole prompt where the gateway asks and stages its KV in host memory where the engine does
# (pdserve_vllm/side_channel.py, whole_prompt.py, host_mirror.py).
PROGRESS_CONNECTOR_MODULE = "pdserve_vllm.nixl_progress"
HYBRID_CONNECTOR_MODULE = "pdserve_vllm.hybrid_connector"
# The prefill engine only produces KV cache, the decode engine only consumes it.
KV_ROLES = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}


@dataclass(frozen=True, slots=True)
class EngineCommand:
    argv: list[str]
    env: dict[str, str] = field(repr=False)  # added to the parent's (engine_environ); holds the engine key
    # What pdserve chose for this engine and why, written at the top of its log: `pdserve verify`
    # and the gateway read them back from there (engines/kv_path.py), wherever the engine runs.
    notes: tuple[str, ...] = ()


def build_engine_command(
    spec: EngineSpec, *, model: ModelSpec, model_path: str, layout: ModelLayout, kv: KVTransferSpec, python: str,
    host: str, cpu_bind: str, link: HostLink, otlp_traces_endpoint: str = "", compile_cache_dir: str = "",
    gpu_memory_bytes: int | None = None, engine_key: EngineKey = NO_ENGINE_KEY,
) -> EngineCommand:
    """argv + env for ``spec``. ``cpu_bind`` is VLLM_CPU_OMP_THREADS_BIND for CPU engines; ``layout`` (of the
    model at ``model_path``) adds what a hybrid or multimodal model needs; ``link`` (this host's, from
    ``kv_link.probe_host_link``) decides where the KV buffer lives and the libfabric provider. Raises
    ConfigError when the pool's settings cannot hand that model off. ``otlp_traces_endpoint`` (the
    gateway's, an OTLP/HTTP URL; empty = off) makes the engine export its request spans there too.
    ``compile_cache_dir`` (``launch.cache_dir``; empty = vLLM's own) is where vLLM keeps its compiled model.
    ``gpu_memory_bytes`` (this host's GPU, None = unknown) bounds a hybrid model's KV cache where the pool
    does not fix its size (engines/batch_size.py). ``engine_key`` (engine_key.py) goes in the env, never in argv
    (``ps`` shows argv), and no pool env overrides it.
    """
    pool = spec.pool
    needs = engine_needs(layout, spec, dtype=model.dtype)
    batch_args, batch_note = max_num_seqs_args(spec, shape=layout.recurrent, model=model_path, dtype=model.dtype,
                                               block_size=engine_block_size(spec, kv),
                                               gpu_memory_bytes=gpu_memory_bytes, weight_bytes=layout.weight_bytes)
    buffer = choose_buffer_device(kv, pool, link)
    is_cross_layer = wants_cross_layer_blocks(kv, pool, layout=layout, buffer_device=buffer.device)
    argv = [
        python, "-m", CPU_SERVER_MODULE if pool.device == "cpu" else VLLM_SERVER_MODULE,
        "--model", model_path,
        "--served-model-name", model.served_name,
        "--host", host,
        "--port", str(spec.port),
        "--max-model-len", str(model.max_model_len),
        "--dtype", model.dtype,
        "--tensor-parallel-size", str(pool.tensor_parallel_size),
        "--kv-transfer-config", json.dumps(kv_transfer_config(spec, kv, buffer_device=buffer.device,
                                                              is_cross_layer=is_cross_layer, layout=layout.layout)),
        *_block_size_args(spec, kv),
        "--enable-prompt-tokens-details",  # each reply's cached tokens: proof its KV crossed (pd/kv_proof.py)
        "--disable-access-log-for-endpoints", ",".join(POLLED_PATHS),
        # Every route but GET /health requires the engine key; vLLM's own --api-key guards only /v1 and a few more.
        "--middleware", ENGINE_KEY_MIDDLEWARE,
        *needs.args,
        *_tracing_args(otlp_traces_endpoint),
        *_cpu_executor_args(pool),
        *_gpu_memory_args(pool),
        *batch_args,
        # A decode engine continues after the prefill engine's token (pd/first_token.py); loaded in every engine,
        # it costs a step nothing while no request names a token.
        *(["--logits-processors", FIRST_TOKEN_PROCESSOR] if pool.forces_first_token else []),
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
        # A media URL the gateway let through (access.media_url_domains) must not redirect the engine's fetch to a
        # host it did not check (vLLM follows redirects by default: envs.py VLLM_MEDIA_URL_ALLOW_REDIRECTS).
        "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0",
    }
    if pool.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in spec.gpu_ids)
        # UCX disables cuda_ipc reads (vLLM's decode-side pull) when NVML reports no NVLink,
        # as on single-GPU VMs, and falls back to TCP at ~20 MB/s; see docs/transport.md.
        env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(pool.kv_cache_gib)
        env[CPU_BIND_ENV] = cpu_bind
        env.update(CPU_ENGINE_ENV)
        if cores := parse_cpu_list(cpu_bind):
            env["OMP_NUM_THREADS"] = str(len(cores))  # else vLLM's uni executor runs one thread, or the host's all
    if delay_us := progress_delay_us(spec, kv):
        env[PROGRESS_DELAY_ENV] = str(delay_us)
    if compile_cache_dir:
        env[COMPILE_CACHE_ENV] = compile_cache_dir
    if otlp_traces_endpoint:
        env[OTLP_PROTOCOL_ENV] = "http/protobuf"  # vLLM's default is gRPC; one URL serves gateway and engines
    if "LIBFABRIC" in kv.backends:
        env.update(libfabric_env(libfabric_provider(kv, pool, link)[0]))
    if is_cross_layer:
        env[V2_RUNNER_ENV] = "0"
    env.update(transport_env(spec.host, kv=kv, pool=pool, link=link))  # NIXL listens on the engine's interface alone
    env.update(needs.env)
    env.update(pool.env)
    env.update(engine_key.engine_env())
    notes = kv_notes(kv, pool, link=link, buffer=buffer, env=env) + ((batch_note,) if batch_note else ())
    return EngineCommand(argv=argv, env=env, notes=notes)


def engine_environ(parent: Mapping[str, str], command: EngineCommand) -> dict[str, str]:
    """The environment an engine starts with: ``parent``'s less every PDSERVE_* variable, then the command's own.
    An engine reads none of pdserve's (what it needs, the command sets), and some are secrets it must not hold:
    the gateway's client and admin keys (access.py)."""
    return {name: value for name, value in parent.items() if not name.startswith(ENV_PREFIX)} | command.env


def kv_notes(
    kv: KVTransferSpec, pool: PoolSpec, *, link: HostLink, buffer: BufferChoice, env: dict[str, str]
) -> tuple[str, ...]:
    """Where the KV buffer lives and, for LIBFABRIC, the provider in force (``env`` may be the pool's pick)."""
    notes = [f"{BUFFER_NOTE} {buffer.device}: {buffer.reason}"]
    if "LIBFABRIC" in kv.backends:
        provider, why = libfabric_provider(kv, pool, link)
        in_force = env["FI_PROVIDER"]
        notes.append(f"{PROVIDER_NOTE} {in_force}: {why if in_force == provider else 'set in the pool env'}")
    return tuple(notes)


# Each KV block of each layer is one NIXL descriptor, and posting descriptors, not moving bytes,
# dominated the handoff on an H200: 128-token blocks cut the decode engine's inter-token p99 under
# load from 49 to 14 ms and tripled its KV bandwidth (docs/transport.md).
GPU_BLOCK_SIZE = 128


# A CPU engine runs its model in the engine-core process (vLLM's "uni" executor) instead of a worker
# process of its own: on the 2-core demo at 4 req/s that took inter-token p50 from 7.4-7.7 to 4.6-4.9
# ms, and the engines were ready 11-17 s sooner; at 1-2 req/s the inter-token floor rose instead
# (docs/benchmarks.md, sections 2 and 9). vLLM-CPU forces its "mp" executor
# unless VLLM_ENABLE_V1_MULTIPROCESSING is 0; the API server still runs the engine core apart.
# vLLM-CPU 0.32 saves an AOT-compiled model at each start and fails to load it at the next
# ("'function' object has no attribute 'finalize_loading'"): compiling without AOT takes less.
# The engine core is forked from the API server (pdserve_vllm/engine_server.py), where vLLM-CPU spawns
# it and so imports torch and vLLM twice: `pdserve up` was ready in 21-29 s against 30-35, and the
# serving figures of six rounds each overlap (docs/benchmarks.md, section 9). A pool env of
# VLLM_WORKER_MULTIPROC_METHOD=spawn brings vLLM-CPU's way back.
CPU_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_AOT_COMPILE": "0",
                  "VLLM_WORKER_MULTIPROC_METHOD": "fork"}


def _cpu_executor_args(pool: PoolSpec) -> list[str]:
    """vLLM's "uni" executor for a CPU engine of one worker; a pool's extra_args can name another."""
    is_one_worker = pool.tensor_parallel_size == 1
    return ["--distributed-executor-backend", "uni"] if pool.device == "cpu" and is_one_worker else []


def _gpu_memory_args(pool: PoolSpec) -> list[str]:
    """The pool's typed GPU-memory settings as vLLM flags (the reference serves a 9B model on a 24 GB L4
    with both: 0.90 of the GPU, no CUDA graphs)."""
    args = ["--enforce-eager"] if pool.enforce_eager else []
    if pool.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(pool.gpu_memory_utilization)]
    return args


def _tracing_args(otlp_traces_endpoint: str) -> list[str]:
    """vLLM's own spans, children of the leg's span through the traceparent the gateway sends."""
    return ["--otlp-traces-endpoint", otlp_traces_endpoint] if otlp_traces_endpoint else []


# vLLM-CPU's own block size where none is asked for (vllm/platforms/cpu.py, check_and_update_config).
CPU_BLOCK_SIZE = 128


def _block_size_args(spec: EngineSpec, kv: KVTransferSpec) -> list[str]:
    """``--block-size`` unless the engine's extra_args already set it."""
    if flag_value(spec.pool.extra_args, "--block-size") is not None:
        return []
    block_size = kv.block_size or (GPU_BLOCK_SIZE if spec.pool.device == "cuda" else None)
    return [] if block_size is None else ["--block-size", str(block_size)]


def engine_block_size(spec: EngineSpec, kv: KVTransferSpec) -> int:
    """The attention block size the engine runs with: extra_args', kv.block_size, else pdserve's GPU
    default or vLLM-CPU's."""
    given = flag_value(spec.pool.extra_args, "--block-size")
    if given is not None and given.isdigit():
        return int(given)
    return kv.block_size or (GPU_BLOCK_SIZE if spec.pool.device == "cuda" else CPU_BLOCK_SIZE)


def kv_transfer_config(
    spec: EngineSpec, kv: KVTransferSpec, *, buffer_device: str, is_cross_layer: bool = False,
    layout: Layout = Layout.ATTENTION,
) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for one engine: unique engine_id, role, buffer device; vLLM's
    connector always taken from a pdserve module, which keys its side channel: the hybrid one for a hybrid model (its
    prefill engine's token can then lead a streamed completion, and a GPU engine can stage its KV in host memory)."""
    extra: dict[str, Any] = {"backends": list(kv.backends)}
    if is_cross_layer:
        extra[CROSS_LAYER_KEY] = True
    config = {
        "kv_connector": kv.connector,
        "kv_role": KV_ROLES[spec.role],
        "engine_id": spec.engine_id,
        "kv_buffer_device": buffer_device,
        "kv_connector_extra_config": extra,
        "kv_load_failure_policy": kv.load_failure_policy,
    }
    config["kv_connector_module_path"] = HYBRID_CONNECTOR_MODULE if layout is Layout.HYBRID else PROGRESS_CONNECTOR_MODULE
    return config


# vLLM 0.26's NixlConnector registers each KV block across all layers as one descriptor with this
# extra_config key, on FlashAttention, FlashInfer or Triton attention in the HND layout (its default for
# NIXL), without Mamba-style layers (kv_connector/v1/nixl/connector.py, prefer_cross_layer_blocks). Its
# host staging buffer expects per-layer tensors, and its V2 model runner, the default for dense models,
# registers per layer whatever the key says (v1/worker/gpu/kv_connector.py): V1's runner is asked for.
# Prefill and decode must agree: it enters NIXL's handshake hash, so pdserve gives both the same.
CROSS_LAYER_KEY = "enable_cross_layers_blocks"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def wants_cross_layer_blocks(kv: KVTransferSpec, pool: PoolSpec, *, layout: ModelLayout, buffer_device: str) -> bool:
    """Whether an engine registers cross-layer KV blocks. Raises ConfigError for ``on`` where vLLM cannot."""
    allowed = pool.device == "cuda" and buffer_device == "cuda" and layout.layout is Layout.ATTENTION
    if kv.cross_layer_blocks == "on" and not allowed:
        raise ConfigError(f"kv.cross_layer_blocks: on needs GPU engines with the KV buffer in GPU memory and a model "
                          f"of attention layers only; here: device {pool.device}, kv buffer {buffer_device}, "
                          f"{layout.evidence}")
    return kv.cross_layer_blocks == "on" or (kv.cross_layer_blocks == "auto" and allowed)


# NIXL's progress thread spins a core per engine with no pause; 100 us leaves it near idle on CPU
# engines (docs/transport.md). GPU engines keep NIXL's own 0 until a pause is measured there.
CPU_PROGRESS_DELAY_US = 100


def progress_delay_us(spec: EngineSpec, kv: KVTransferSpec) -> int:
    """The pause of this engine's NIXL progress thread between rounds; 0 leaves NIXL as it is."""
    if kv.progress_delay_us is not None:
        return kv.progress_delay_us
    return CPU_PROGRESS_DELAY_US if spec.pool.device == "cpu" else 0


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
