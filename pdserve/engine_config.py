"""The engine parts of the configuration tree (config.py's Settings): the model, the prefill and decode
pools, how KV travels between them (``kv``), how engines are launched (``launch``), and one engine's spec."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from pdserve.role import Role
from pdserve.spec_base import FrozenSpec

DEMO_MODEL_NAME = "pdserve-demo"
LOCAL_ENGINE_HOST = "127.0.0.1"  # where the gateway reaches engines `pdserve up` launched
MpsMode = Literal["auto", "on", "off"]
LogFormat = Literal["text", "json"]


def yaml_on_off(value: object) -> object:
    """YAML 1.1 reads a bare on/off as a boolean: back to the word an on|off|auto field takes."""
    return ("on" if value else "off") if isinstance(value, bool) else value


class ModelSpec(FrozenSpec):
    """Which model every engine serves. ``path: null`` means the built-in demo model."""

    path: str | None = Field(None, description="HF model dir or id; null = built-in demo model")
    served_name: str = Field(DEMO_MODEL_NAME, description="name clients send as `model`")
    max_model_len: int = Field(2048, gt=0, description="context length in tokens")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"


class PlacementSpec(FrozenSpec):
    """Where a cluster puts each engine of a pool: Ray Serve replica options and Kubernetes pods.

    ``pdserve up`` on one host ignores it; GPUs per engine come from ``tensor_parallel_size``.
    """

    cpus: float = Field(2.0, gt=0, description="CPUs reserved per engine (Ray num_cpus, pod request)")
    memory_gib: float = Field(32.0, gt=0, description=(
        "memory limit per engine pod; leave room above the weights for their page cache"))
    resources: dict[str, float] = Field(default_factory=dict, description=(
        "Ray custom resources per engine, e.g. {prefill: 1} to land only on nodes that offer `prefill`"))
    node_labels: dict[str, str] = Field(default_factory=dict, description=(
        "Kubernetes nodeSelector for this pool's worker pods"))
    efa_devices: int = Field(0, ge=0, description=(
        "EFA interfaces per engine (vpc.amazonaws.com/efa); > 0 moves KV over NIXL's LIBFABRIC backend"))


# vLLM flags that rule out pdserve's logits processor, and those that parse chat output (vLLM 0.32's CLI).
_NO_FIRST_TOKEN_FLAGS = ("--logits-processors", "--speculative-config")
_CHAT_PARSER_FLAGS = ("--reasoning-parser", "--tool-call-parser", "--enable-auto-tool-choice")


class PoolSpec(FrozenSpec):
    """One pool of engines of the same role (prefill or decode)."""

    engines: int = Field(1, ge=0, description="engines to launch (0 with urls = external)")
    device: Literal["cpu", "cuda"] = "cpu"
    gpu_ids: list[int] = Field(default_factory=list, description="GPUs, tp_size per engine")
    tensor_parallel_size: int = Field(1, ge=1)
    base_port: int = Field(8100, ge=1, le=65535, description="engine i listens on base_port+i")
    cpu_threads_bind: list[str] = Field(
        default_factory=list,
        description=("VLLM_CPU_OMP_THREADS_BIND per engine (on Ray: per replica on a node), or one for all, "
                     "e.g. ['0-3']; empty = split this host's cores (on Ray: the node's)"),
    )
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE for CPU engines")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description=(
        "share of each GPU's memory vLLM may take for weights, activations and KV cache "
        "(--gpu-memory-utilization); null = vLLM's own 0.9"))
    enforce_eager: bool = Field(False, description=(
        "run the model eagerly, without CUDA graphs (--enforce-eager): less GPU memory and a faster start, "
        "slower decode steps"))
    max_num_seqs: int | None = Field(None, ge=1, description=(
        "sequences one engine runs at once (--max-num-seqs); null = vLLM's default, or for a hybrid (Gated "
        "DeltaNet) model what its KV cache holds where that is fewer and pdserve knows its size: kv_cache_gib on "
        "CPU; on GPU --kv-cache-memory-bytes, else the GPU's share less the weights (engines/batch_size.py)"))
    extra_args: list[str] = Field(default_factory=list, description="extra vLLM CLI args")
    env: dict[str, str] = Field(default_factory=dict, description="extra engine env vars")
    urls: list[str] = Field(default_factory=list, description="already-running engines, http://host:port")
    placement: PlacementSpec = PlacementSpec()
    first_token_processor: bool | None = Field(None, description=(
        "whether the engines load pdserve's first-token logits processor (pdserve_vllm/first_token.py), with which "
        "a decode engine carries on from the prefill engine's token (chat; completions with stop strings, "
        "penalties or a seed); null = the engines pdserve launches do unless extra_args name --logits-processors "
        "or --speculative-config, engines at urls do not (true: they were started with --logits-processors "
        "pdserve_vllm.first_token:FirstTokenProcessor)"))

    @field_validator("urls")
    @classmethod
    def _plain_http_origins(cls, urls: list[str]) -> list[str]:
        """The gateway's engine client speaks plain HTTP/1.1 and appends /v1/... itself."""
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname or parts.path.strip("/") or parts.query:
                raise ValueError(f"{url!r} is not of the form http://host:port")
        return [url.rstrip("/") for url in urls]

    @property
    def forces_first_token(self) -> bool:
        """Whether this pool's engines start a request with a token it is given (pdserve_vllm/first_token.py):
        as ``first_token_processor`` says, else pdserve launches them with that logits processor unless their
        extra_args load logits processors of their own or speculative decoding (vLLM refuses custom logits
        processors with it: build_logitsprocs, 0.32); engines it does not launch (urls) are not known to."""
        if self.first_token_processor is not None:
            return self.first_token_processor
        return not self.urls and not any(
            arg == flag or arg.startswith(f"{flag}=") for arg in self.extra_args for flag in _NO_FIRST_TOKEN_FLAGS)

    @property
    def parses_chat(self) -> bool:
        """Whether its engines run a reasoning or tool-call parser over chat output (extra_args)."""
        return any(arg == flag or arg.startswith(f"{flag}=") for arg in self.extra_args for flag in _CHAT_PARSER_FLAGS)

    @property
    def tool_call_parser(self) -> str | None:
        """The tool-call parser its engines run (--tool-call-parser in extra_args), if any."""
        for index, arg in enumerate(self.extra_args):
            if arg.startswith("--tool-call-parser="):
                return arg.split("=", 1)[1]
            if arg == "--tool-call-parser" and index + 1 < len(self.extra_args):
                return self.extra_args[index + 1]
        return None

    @model_validator(mode="after")
    def _check_gpus(self) -> PoolSpec:
        if self.device == "cuda" and self.engines:
            needed = self.engines * self.tensor_parallel_size
            if len(self.gpu_ids) < needed:
                raise ValueError(f"gpu_ids needs {needed} ids for {self.engines} engine(s)")
        if len(self.cpu_threads_bind) not in (0, 1, self.engines):
            raise ValueError("cpu_threads_bind needs one entry per engine, or one for all")
        if self.gpu_memory_utilization is not None and self.device != "cuda":
            raise ValueError("gpu_memory_utilization is for device: cuda (CPU engines size their KV cache "
                             "with kv_cache_gib)")
        return self


class KVTransferSpec(FrozenSpec):
    """How the KV cache travels from prefill to decode engines (vLLM's kv_transfer_config)."""

    connector: Literal["NixlConnector"] = "NixlConnector"
    buffer_device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "auto = cpu for CPU engines; for GPU engines cuda where the link can read GPU memory, else cpu "
        "(engines/kv_link.py)"))
    backends: list[Literal["UCX", "LIBFABRIC"]] = Field(["UCX"], description=(
        "NIXL backends; LIBFABRIC needs libfabric >= 2.x with the ABI of NIXL's plugin and libcuda (docs/transport.md)"))
    libfabric_provider: Literal["auto", "efa", "tcp", "shm", "sockets", "verbs"] = Field("auto", description=(
        "FI_PROVIDER of the LIBFABRIC backend; auto = efa where EFA is placed or present, else tcp"))
    block_size: int | None = Field(None, ge=16, multiple_of=16, description=(
        "KV block size in tokens (--block-size); auto = 128 on GPU engines (8x fewer NIXL descriptors per "
        "handoff than vLLM's 16), vLLM's own default on CPU"))
    side_channel_base_port: int = Field(5600, ge=1, le=65535)
    progress_delay_us: int | None = Field(None, ge=0, le=100_000, description=(
        "pause of each engine's NIXL progress thread between rounds, in microseconds; auto = 100 on CPU "
        "engines (NIXL's own 0 spins a core per engine, docs/transport.md), NIXL's 0 on GPU engines"))
    cross_layer_blocks: Literal["auto", "on", "off"] = Field("auto", description=(
        "register each KV block across all layers as one NIXL descriptor (vLLM's enable_cross_layers_blocks) "
        "instead of one per layer; auto = on for GPU engines of attention-only models with the KV buffer in "
        "GPU memory, where vLLM 0.26 allows it"))
    _cross_layer_on_off = field_validator("cross_layer_blocks", mode="before")(yaml_on_off)
    load_failure_policy: Literal["recompute", "fail"] = Field("recompute", description=(
        "what a decode engine does when its KV pull fails (vLLM kv_load_failure_policy): recompute the "
        "prompt itself, or fail the request"))



class LaunchSpec(FrozenSpec):
    ready_timeout_s: float = Field(900.0, gt=0, description="per engine, load + warm-up")
    log_dir: str = Field("", description=(
        "engine log files, one per engine; empty = .pdserve/logs/gateway-<gateway.port>, so two deployments "
        "started from one folder never share one"))
    log_format: LogFormat = Field("text", description=(
        "pdserve's own log lines on stderr (`up`, `serve`): text, or json = one object per line with "
        "request_id, role, endpoint and timings as fields (--log-format)"))
    max_restarts: int = Field(5, ge=0, description="per engine, before giving up")
    python: str = Field("", description="interpreter for engines; empty = this one")
    allow_vllm_version: str = Field("", description=(
        "a vLLM version outside pdserve's supported range (pdserve_vllm/versions.py, docs/versions.md) that engines "
        "may run anyway, e.g. '0.35.0': `up` and `serve` then warn instead of refusing, and `status` says so; each "
        "hook still checks the vLLM names it needs as its engine starts"))
    cache_dir: str = Field("", description=(
        "where engines keep vLLM's compiled model (VLLM_CACHE_ROOT), so a second start loads it instead of "
        "compiling for minutes; empty = vLLM's own ~/.cache/vllm"))
    engine_host: str = Field("127.0.0.1", description=(
        "address engines bind to, and the one they give other hosts for their KV (NIXL's side channel) and "
        "the gateway reaches them at: on separate machines, this machine's address on the link between them"))
    restart_backoff_s: float = Field(2.0, gt=0, description="first restart delay, doubled each time")
    mps: MpsMode = Field("auto", description=(
        "CUDA MPS daemon when engines share a GPU; auto = if nvidia-cuda-mps-control is installed"))
    max_engines_per_pool: int = Field(16, ge=1, le=256, description=(
        "the most engines `pdserve scale` may run in one pool on this host"))
    drain_timeout_s: float = Field(300.0, gt=0, description=(
        "`pdserve scale` down: how long a removed engine may finish what it runs before it is stopped anyway"))

    _mps_on_off = field_validator("mps", mode="before")(yaml_on_off)

    @property
    def engine_address(self) -> str:
        """Where launched engines are reached: ``engine_host``, or this host's loopback for a wildcard bind."""
        return LOCAL_ENGINE_HOST if self.engine_host in ("0.0.0.0", "::", "") else self.engine_host


class EngineSpec(FrozenSpec):
    """One engine to launch: its pool's settings plus what makes it unique on its host."""

    role: Role
    index: int
    port: int
    side_channel_port: int
    gpu_ids: list[int]
    cpu_threads_bind: str
    pool: PoolSpec
    host: str = LOCAL_ENGINE_HOST
    instance: str = Field("", description=(
        "unique across restarts: a Ray replica id, or the index and a token new at each start (engines/supervisor.py)"))

    @property
    def name(self) -> str:
        return f"{self.role.value}-{self.index}"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine_id(self) -> str:
        """NIXL's engine id: a replaced engine must not inherit its predecessor's handshakes."""
        return f"pdserve-{self.role.value}-{self.instance or self.index}"
