"""The gateway parts of the configuration tree (config.py's Settings): the gateway's address, deadlines,
limits and failure handling (``gateway``), and how it routes requests to engines (``routing``)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from pdserve.spec_base import FrozenSpec

NODE_HOST = "node"  # gateway.host on Ray: each replica binds the address of the node it runs on


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
    max_header_bytes: int = Field(16 * 1024, gt=0, description=(
        "request line and headers together, counted as they arrive; more gets 431 and the connection closed"))
    header_timeout_s: float = Field(10.0, gt=0, description=(
        "a request's line and headers must be whole this long after its first byte, or after the connection "
        "opens, else the connection is closed (a slow or half-sent request holds nothing)"))
    idle_timeout_s: float = Field(30.0, gt=0, description="a keep-alive connection with no request this long is closed")
    max_connections: int = Field(8192, ge=16, description=(
        "connections one gateway process keeps open (at most its open-file limit less a reserve); a new one past "
        "it closes the longest idle, or, with none idle, is closed itself"))
    max_stream_buffer_bytes: int = Field(4 * 1024 * 1024, gt=0, description=(
        "reply bytes held for one client that reads slower than the engine writes; past it the stream ends with "
        "an error event (memory stays bounded per stream)"))
    max_schema_bytes: int = Field(64 * 1024, gt=0, description=(
        "a structured-output schema, grammar or regex (response_format, structured_outputs, tools' parameters) "
        "longer than this as JSON gets 400 before any engine compiles it"))
    max_schema_nodes: int = Field(4096, gt=0, description=(
        "JSON values in one request's schemas (objects, arrays, enum entries, ...), what their compile time grows "
        "with; more gets 400"))
    ssl_certfile: str = Field("", description=(
        "PEM certificate chain: the gateway serves HTTPS (with ssl_keyfile; both or neither)"))
    ssl_keyfile: str = Field("", description="PEM private key of ssl_certfile, unencrypted")
    api_keys_file: str = Field("", description=(
        "client API keys, one per line (or PDSERVE_API_KEYS, comma-separated); with no key at all the gateway is "
        "open, which it may be only on loopback or with access.open"))
    admin_key_file: str = Field("", description=(
        "the admin key (or PDSERVE_ADMIN_KEY): needed, once any key is set, for /metrics, /health's engine listing, "
        "/admin/* and /dashboard; it opens the OpenAI routes too"))
    engine_key_file: str = Field("", description=(
        "the key every engine requires (or PDSERVE_ENGINE_KEY), one line: that of the engines at prefill/decode urls, "
        "or one for the engines `pdserve up` launches; empty = `pdserve up` makes a new one per deployment (kept in "
        "its run folder while it runs), and engines at urls need none"))
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
        "what one transfer may take beyond its bytes at slow_kv_gbps, unblamed on the link: small ones are "
        "latency-bound (pd/slow_kv.py)"))
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

    @property
    def scheme(self) -> str:
        """How clients reach the gateway: https once it has a certificate."""
        return "https" if self.ssl_certfile else "http"

    @model_validator(mode="after")
    def _check_tls_pair(self) -> GatewaySpec:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("ssl_certfile and ssl_keyfile go together: set both (HTTPS) or neither (HTTP)")
        return self


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
