"""The typed configuration tree: load it, validate it, derive per-engine specs.

Precedence: defaults < YAML file < environment (``PDSERVE_SECTION__FIELD``) < flags.
This is the only module that reads ``os.environ``; everything else receives typed objects.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from pdserve.cluster_config import EksSpec, KubernetesSpec, RaySpec
from pdserve.errors import ConfigError
from pdserve.role import Role
from pdserve.spec_base import FrozenSpec

ENV_PREFIX = "PDSERVE_"
DEMO_MODEL_NAME = "pdserve-demo"
NODE_HOST = "node"  # gateway.host on Ray: each replica binds the address of the node it runs on
DECODE_BASE_PORT = 8200


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


class GatewaySpec(FrozenSpec):
    host: str = Field("127.0.0.1", description=(
        f"address the gateway binds; on Ray, {NODE_HOST} = the address of the node each replica runs on"))
    replicas: int = Field(1, ge=1, description=(
        "gateway replicas on Ray and Kubernetes, at most one per node offering ray.gateway_resources, each serving "
        "the API; `pdserve up` runs one (its gateway.workers share the port)"))
    port: int = Field(8000, ge=1, le=65535)
    connect_timeout_s: float = Field(5.0, gt=0)
    link_timeout_s: float = Field(30.0, gt=0, description=(
        "a connection to an engine whose host acknowledges nothing for this long fails (TCP keepalive and "
        "TCP_USER_TIMEOUT): a cut link sends no reset, and a whole reply has no bytes to wait on until its end"))
    # Deadlines per phase: past one, the leg is aborted on its engine (its connection closed), then
    # retried elsewhere where nothing reached the client yet, else reported (504 or an SSE error).
    prefill_timeout_s: float = Field(300.0, gt=0, description="whole prefill leg")
    first_token_timeout_s: float = Field(120.0, gt=0, description=(
        "from sending the decode leg to its first byte: the KV pull and the wait in a busy engine's queue"))
    kv_pull_timeout_s: float = Field(60.0, gt=0, description=(
        "a PD request's first token from its decode engine, at most this long after the decode leg is sent; "
        "past it the KV pull is taken for lost (a link cut between the engines mid-pull hangs it: vLLM times "
        "it out only at the prefill engine's lease) and a decode engine, the same one too, prefills the request itself; "
        "a whole reply, whose headers come with its last token, only where its decode engine counts a pull pending "
        "(gateway/whole_pull.py)"))
    decode_idle_timeout_s: float = Field(30.0, gt=0, description="longest silence between tokens once they flow")
    request_timeout_s: float = Field(3600.0, gt=0, description="whole request, first byte to last token")
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    max_header_bytes: int = Field(16 * 1024, gt=0, description="request line and headers together; more gets 431")
    api_keys_file: str = Field("", description=(
        "client API keys, one per line (or PDSERVE_API_KEYS, comma-separated); none = no key needed"))
    admin_key_file: str = Field("", description=(
        "the admin key (or PDSERVE_ADMIN_KEY): needed, once any key is set, for /health's engine listing"))
    leg_attempts: int = Field(2, ge=1, description="endpoints tried per leg before failing")
    local_fallback: bool = Field(True, description=(
        "when no prefill engine could prefill a request, the decode engine prefills it itself (no error)"))
    first_token_from_prefill: bool = Field(True, description=(
        "a streamed completion or chat gets the prefill engine's token as its first token at once, and the "
        "decode engine continues from it (attention-only models; chat and some completion fields need the decode "
        "engines' first_token_processor; pd/first_token.py says which requests, pdserve_first_tokens why not)"))
    native_relay: bool = Field(True, description=(
        "after its first token, a stream's chunks go from the engine's socket to the client's in a C thread "
        "(pd/native_relay.py), not through the event loop: about half the gateway's CPU per chunk; "
        "false, or an install without the compiled module: every chunk in Python"))
    resume_streams: bool = Field(True, description=(
        "a stream whose decode engine fails mid-generation goes on from another decode engine "
        "(not for seeded sampling, guided decoding or tool calls: those end with an error event)"))
    eject_after_failures: int = Field(3, ge=1, description=(
        "failed legs in a row that take an engine out of rotation, even while its /health answers"))
    eject_for_s: float = Field(5.0, gt=0, description="first pause of an ejected engine, doubled per ejection in a row")
    eject_max_s: float = Field(60.0, gt=0, description="longest pause of an ejected engine")
    health_interval_s: float = Field(2.0, gt=0, description="between health probes; every 0.25 s while a role has none healthy")
    health_timeout_s: float = Field(5.0, gt=0, description="a busy engine answers /health slowly")
    unhealthy_after_failures: int = Field(3, ge=1, description="failed probes in a row to eject")
    slow_handoff_warn_s: float = Field(1.0, gt=0, description=(
        "a KV handoff or transfer slower than this is reported: a WARNING when the engine's own transfers "
        "were slow, else a note that the decode engine was busy"))
    slow_kv_gbps: float = Field(0.5, gt=0, description="warn when engines move KV slower than this")
    slow_kv_min_ms: float = Field(100.0, ge=0, description=(
        "but not when transfers take less than this on average: small ones are latency-bound"))
    kv_scrape_interval_s: float = Field(5.0, gt=0, description="how often engines' KV counters are read")
    workers: int = Field(default_factory=lambda: len(os.sched_getaffinity(0)), ge=1, description=(
        "gateway processes sharing the port (SO_REUSEPORT); default: the cores available. "
        "The Ray gateway replica runs one"))
    busy_log_interval_s: float = Field(60.0, gt=0, description=(
        "at most one 'decode engine busy' line per engine, and one 'requests wait' line per gateway process, this often"))
    # Overload (gateway/admission.py): defaults far above what one healthy deployment carries,
    # there only to bound memory and latency. Every count is per gateway process (gateway.workers).
    max_in_flight: int = Field(4096, ge=1, description=(
        "requests one gateway process serves at once (each of gateway.workers has its own); more wait in the queue"))
    max_in_flight_per_engine: int = Field(256, ge=1, description=(
        "legs one gateway process keeps open on one engine, per role; vLLM batches at most 256 on GPU "
        "(max_num_seqs), so more would only wait inside the engine"))
    max_queued: int = Field(1024, ge=0, description=(
        "requests one gateway process lets wait for a slot; more get 429 at once (0: no queue)"))
    queue_timeout_s: float = Field(30.0, gt=0, description="longest wait for a slot before a 429")
    otlp_traces_endpoint: str = Field("", pattern=r"^(https?://\S+)?$", description=(
        "OTLP/HTTP traces URL, e.g. http://127.0.0.1:4318/v1/traces: the gateway exports a span tree per request "
        "and the engines it launches join it (vLLM --otlp-traces-endpoint); empty = off"))


class RoutingSpec(FrozenSpec):
    """Which engines serve a request, and whether disaggregating it pays (docs/routing.md)."""

    disaggregation: Literal["auto", "always", "never"] = Field("always", description=(
        "always = every request through a prefill engine; auto = per request: prefill on the decode engine "
        "where disaggregating does not pay (docs/routing.md); never = decode engines do both phases. "
        "X-PD-Mode overrides"))
    chars_per_token: float = Field(4.0, gt=0, description="prompt tokens are estimated from characters at this rate")
    prefix_chunk_chars: int = Field(256, ge=16, description=(
        "prompts are hashed in chunks of this many characters to estimate what each engine has cached"))
    home_key_chars: int = Field(1024, ge=1, description=(
        "a completion prompt's home decode engine, which every gateway process agrees on, follows from its first "
        "this many characters (a chat's from its messages up to the first user message)"))
    prefix_cache_tokens: int = Field(262144, ge=1, description=(
        "an engine's prefix cache in tokens, until its /metrics reports the size of its KV cache"))
    cached_tokens_per_request: float = Field(1024.0, gt=0, description=(
        "decode cost: this many prompt tokens cached on an engine weigh as much as one more request on it"))
    affinity_margin_requests: float = Field(1.0, ge=0, description=(
        "decode: the engine holding most of a prompt's prefix keeps it unless another is cheaper by more than "
        "the prefix is worth in requests, at most this many, beyond the recompute the cost already counts "
        "(hysteresis)"))
    waiting_weight: float = Field(1.0, ge=0, description=(
        "decode cost: what a request waiting in an engine's queue weighs on top of being a request"))
    kv_usage_weight: float = Field(4.0, ge=0, description=(
        "decode cost: a full KV cache weighs as much as this many requests (a fuller cache preempts sooner)"))
    kv_usage_full: float = Field(0.95, gt=0, le=1, description=(
        "a decode engine whose KV cache is this full gets no request while another has room"))
    local_max_uncached_tokens: int = Field(512, ge=0, description=(
        "auto: a prompt with at most this many tokens not cached on its decode engine is prefilled there"))
    prefill_saturated_tokens: int = Field(16384, ge=1, description=(
        "a prefill engine with this many uncached prompt tokens queued by this gateway process is saturated"))
    prefill_saturated_waiting: int = Field(4, ge=1, description=(
        "so is one with this many requests waiting in its scheduler (every gateway process's)"))
    decode_room_kv_usage: float = Field(0.7, gt=0, le=1, description=(
        "auto: while every prefill engine is saturated, a decode engine with no request waiting and its KV "
        "cache less full than this prefills the prompt itself"))
    load_scrape_interval_s: float = Field(1.0, gt=0, description="how often engines' load is read from their /metrics")
    load_max_age_s: float = Field(10.0, gt=0, description=(
        "an engine load read longer ago than this is ignored: routing uses this gateway's own counts"))

    @model_validator(mode="after")
    def _check_load_age(self) -> RoutingSpec:
        if self.load_max_age_s <= self.load_scrape_interval_s:
            raise ValueError("load_max_age_s must exceed load_scrape_interval_s, or every read is stale")
        return self


MpsMode = Literal["auto", "on", "off"]
LogFormat = Literal["text", "json"]
DEFAULT_LOG_ROOT = Path(".pdserve/logs")
LOCAL_ENGINE_HOST = "127.0.0.1"  # where the gateway reaches engines `pdserve up` launched


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


class Settings(FrozenSpec):
    model: ModelSpec = ModelSpec()
    prefill: PoolSpec = PoolSpec()
    decode: PoolSpec = PoolSpec(base_port=DECODE_BASE_PORT)
    kv: KVTransferSpec = KVTransferSpec()
    gateway: GatewaySpec = GatewaySpec()
    routing: RoutingSpec = RoutingSpec()
    launch: LaunchSpec = LaunchSpec()
    ray: RaySpec = RaySpec()
    kubernetes: KubernetesSpec = KubernetesSpec()
    eks: EksSpec = EksSpec()
    cache_dir: str = Field("", description="demo model cache; empty = $XDG_CACHE_HOME/pdserve")

    def pool(self, role: Role) -> PoolSpec:
        return self.prefill if role is Role.PREFILL else self.decode

    def engine_specs(self) -> list[EngineSpec]:
        """One spec per engine to launch, prefill pool first; ports and ids are unique."""
        specs: list[EngineSpec] = []
        for role in Role:
            for index in range(self.pool(role).engines):
                specs.append(self.engine_spec(role, index, side_channel_port=self.kv.side_channel_base_port + len(specs)))
        return specs

    def engine_spec(self, role: Role, index: int, *, side_channel_port: int) -> EngineSpec:
        """Engine ``index`` of ``role``'s pool (one `pdserve scale` adds past the configured count, too)."""
        pool, tp = self.pool(role), self.pool(role).tensor_parallel_size
        return EngineSpec(
            role=role, index=index, port=pool.base_port + index, side_channel_port=side_channel_port,
            gpu_ids=pool.gpu_ids[index * tp : (index + 1) * tp],
            cpu_threads_bind=pool.cpu_threads_bind[index % len(pool.cpu_threads_bind)] if pool.cpu_threads_bind else "",
            pool=pool, host=self.launch.engine_address,
        )

    def endpoint_urls(self, role: Role, *, scalable: bool = False) -> list[str]:
        """Where the gateway sends legs of ``role``: launched engines plus external urls; with
        ``scalable``, every engine `pdserve scale` may launch there too (up to max_engines_per_pool)."""
        pool = self.pool(role)
        count = max(pool.engines, self.launch.max_engines_per_pool) if scalable else pool.engines
        launched = [f"http://{self.launch.engine_address}:{pool.base_port + index}" for index in range(count)]
        return launched + list(pool.urls)

    @model_validator(mode="before")
    @classmethod
    def _decode_ports_default_apart(cls, tree: Any) -> Any:
        """``decode: {engines: 2}`` must not inherit the prefill pool's ports."""
        if isinstance(tree, dict) and isinstance(tree.get("decode"), dict) and "base_port" not in tree["decode"]:
            tree = {**tree, "decode": {**tree["decode"], "base_port": DECODE_BASE_PORT}}
        return tree

    @model_validator(mode="after")
    def _check_ports_unique(self) -> Settings:
        ports = self.local_ports
        clashes = sorted({port for port in ports if ports.count(port) > 1})
        if clashes:
            raise ValueError(f"ports used twice (gateway, engines, side channels): {clashes}")
        return self

    @property
    def local_ports(self) -> list[int]:
        """Every port this deployment binds on this host: gateway, engines, NIXL side channels."""
        ports = [self.gateway.port]
        for spec in self.engine_specs():
            ports += [spec.port, spec.side_channel_port]
        return ports

    @property
    def engine_log_dir(self) -> Path:
        """Where engines of this deployment log: ``launch.log_dir``, else a folder of its own named
        by the gateway port, which no other deployment on this host can hold at the same time."""
        return Path(self.launch.log_dir) if self.launch.log_dir else DEFAULT_LOG_ROOT / f"gateway-{self.gateway.port}"

    @property
    def run_dir(self) -> Path:
        """Where `pdserve up` and its gateway processes share the engines' states (engines/members.py)."""
        return self.engine_log_dir / "run"

    @property
    def demo_model_dir(self) -> Path:
        return Path(self.cache_dir) / "demo-model"


def load_settings(path: Path | None = None, *, overrides: Mapping[str, Any] | None = None) -> Settings:
    """Merge defaults, ``path`` (YAML), ``PDSERVE_*`` env vars and ``overrides`` into Settings.

    ``overrides`` uses dotted keys (``{"gateway.port": 9000}``). Raises ConfigError listing
    every invalid field by its path, before anything is started.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        _deep_merge(tree, _read_yaml(path))
    for key, value in os.environ.items():
        if key.startswith(ENV_PREFIX) and "__" in key:
            _set_dotted(tree, key.removeprefix(ENV_PREFIX).lower().replace("__", "."), value)
    for key, value in (overrides or {}).items():
        _set_dotted(tree, key, value)
    return parse_settings(tree, source=str(path) if path else "defaults")


def parse_settings(tree: Mapping[str, Any], *, source: str) -> Settings:
    """Validate a plain dict; raises ConfigError naming each bad field path.

    An empty ``cache_dir`` becomes this host's cache, so a tree shipped to another node
    (a Ray Serve application's args) finds that node's own cache.
    """
    try:
        return Settings.model_validate({**tree, "cache_dir": tree.get("cache_dir") or _default_cache_dir()})
    except ValidationError as exc:
        problems = [
            f"  {'.'.join(str(part) for part in error['loc']) or '<root>'}: {error['msg']}"
            for error in exc.errors()
        ]
        raise ConfigError(f"invalid configuration ({source}):\n" + "\n".join(problems)) from exc


def secret_env(name: str) -> str:
    """A secret from the environment ('' if unset). Secrets never enter Settings: those are shipped
    to Ray and rendered into manifests."""
    return os.environ.get(name, "")


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return loaded


def _default_cache_dir() -> str:
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(cache_home) / "pdserve")


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value


def _set_dotted(tree: dict[str, Any], dotted_key: str, value: Any) -> None:
    *parents, leaf = dotted_key.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted_key}: {part} is not a section")
        node = child
    node[leaf] = _parse_scalar(value) if isinstance(value, str) else value


def _parse_scalar(text: str) -> Any:
    """Env values are strings; YAML-parse them so lists and numbers work (``[0, 1]``)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text
