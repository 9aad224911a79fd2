"""Every vLLM name pdserve relies on past vLLM's extension points, as data: where it lives, what it is, the shape the
code relying on it assumes, who relies on it and why. Data only: contract_check.py checks it against a vLLM's source
(CI: every release in SUPPORTED_VLLM, tests/engines/test_vllm_contract.py; each hook: the running vLLM, at start).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pdserve_vllm.versions import ANY_VERSION, VersionRange


class Kind(StrEnum):
    """What a name is; every kind also needs its module's file."""

    CLASS = "class"  # a class at the module's top level
    FUNCTION = "function"  # a function or method ("Class.method") with the parameters in ``shape`` (", ...": then more)
    ATTRIBUTE = "attribute"  # "Class.name": a field or property of the class, or set as self.name in one of its methods
    NAME = "name"  # bound at the module's top level or in its __all__; ``shape`` "from M": imported from module M
    BRANCH = "branch"  # the expression ``shape`` appears in ``name`` ('' = the module, a function, a class, a method)
    ENV = "env"  # an environment variable vLLM reads: ``name`` is a string in ``module`` (vllm/envs.py)


class Hook(StrEnum):
    """Who relies on a name: a pdserve_vllm module that runs inside the engine (and checks its names when it loads),
    or a pdserve module that sets what the engine reads (checked in CI only)."""

    ENGINE_SERVER = "pdserve_vllm/engine_server.py"
    NIXL_PROGRESS = "pdserve_vllm/nixl_progress.py"
    HYBRID_CONNECTOR = "pdserve_vllm/hybrid_connector.py"
    KV_INTEGRITY = "pdserve_vllm/kv_integrity.py"
    FIRST_TOKEN = "pdserve_vllm/first_token.py"
    SIDE_CHANNEL = "pdserve_vllm/side_channel.py"
    ENGINE_KEY = "pdserve_vllm/engine_key.py"
    COMMAND = "pdserve/engines/command.py"


@dataclass(frozen=True, slots=True)
class VllmName:
    module: str
    name: str
    kind: Kind
    hook: Hook
    why: str
    shape: str = ""
    versions: VersionRange = ANY_VERSION  # the releases where vLLM has it; others have another entry instead


class Feature(StrEnum):
    """What pdserve does that a vLLM release can take away (pdserve/engines/vllm_version.py knows which settings)."""

    FIRST_TOKEN = "first-token logits processor"
    CROSS_LAYER_BLOCKS = "cross-layer KV blocks"


@dataclass(frozen=True, slots=True)
class Limit:
    """Releases a feature cannot run on, because vLLM took away what it relies on: its hook refuses to load there, and
    ``pdserve up`` refuses a configuration that uses it, naming ``instead``."""

    feature: Feature
    hook: Hook
    versions: VersionRange
    reason: str
    instead: str


NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
CONNECTOR, SCHEDULER, WORKER = f"{NIXL}.connector", f"{NIXL}.base_scheduler", f"{NIXL}.base_worker"
LOGITS_PROCESSOR = "vllm.v1.sample.logits_processor"
SINCE_0_31, BEFORE_0_31 = VersionRange(since="0.31.0"), VersionRange(before="0.31.0")
# Before 0.29 (seen in 0.26, outside SUPPORTED_VLLM: pdserve runs it only where launch.allow_vllm_version names it).
BEFORE_0_29, FROM_0_29_TO_0_31 = VersionRange(before="0.29.0"), VersionRange(since="0.29.0", before="0.31.0")
V1_ONLY, V2_ONLY = VersionRange(before="0.34.0"), VersionRange(since="0.34.0")  # Model Runner V1 left in 0.34

_HYBRID_WHY = "hybrid_connector.py overrides it and calls vLLM's with the same arguments"
_HOST_WHY = "host_mirror.py stages a hybrid's KV in host memory through it (hybrid_connector._stage_through_mirror)"
_RESTORE_WHY = "restore_last.py names the blocks of the step that recomputes a decode request's last prompt token"

ENGINE_SERVER_NAMES = (
    VllmName("vllm.entrypoints.openai.api_server", "", Kind.BRANCH, Hook.ENGINE_SERVER, shape="__name__ == '__main__'",
             why="engines run it as a module (VLLM_SERVER_MODULE; runpy on CPU); vLLM calls that deprecated"),
    VllmName("vllm.platforms.cpu", "CpuPlatform.check_and_update_config", Kind.FUNCTION, Hook.ENGINE_SERVER,
             shape="cls, vllm_config", why="keep_start_method wraps it to put the fork start method back"),
    VllmName("vllm.platforms.cpu", "CpuPlatform.check_and_update_config", Kind.BRANCH, Hook.ENGINE_SERVER,
             shape="os.environ['VLLM_WORKER_MULTIPROC_METHOD']", why="it sets spawn, which keep_start_method undoes"),
)

NIXL_PROGRESS_NAMES = (
    VllmName(NIXL, "NixlConnector", Kind.NAME, Hook.NIXL_PROGRESS, shape=f"from {CONNECTOR}",
             why="the connector class vLLM resolves by name in the connector module pdserve gives it"),
    VllmName("vllm.distributed.nixl_utils", "NixlWrapper", Kind.NAME, Hook.NIXL_PROGRESS,
             why="its module's nixlBind.nixlAgent is what pause_progress_thread wraps"),
    VllmName("vllm.distributed.nixl_utils", "_load_nixl_attr", Kind.BRANCH, Hook.NIXL_PROGRESS, shape="'nixl_agent'",
             why="NixlWrapper is NIXL's nixl_agent, from the module that binds nixlBind"),
)

HYBRID_CONNECTOR_NAMES = (
    VllmName(CONNECTOR, "NixlBaseConnector.__init__", Kind.FUNCTION, Hook.HYBRID_CONNECTOR,
             shape="self, vllm_config, role, kv_cache_config", why=_HYBRID_WHY),
    VllmName(CONNECTOR, "NixlBaseConnector.connector_scheduler", Kind.ATTRIBUTE, Hook.HYBRID_CONNECTOR,
             why="the scheduler side whose truncation and backoff the hooks read"),
    VllmName(CONNECTOR, "NixlBaseConnector.connector_worker", Kind.ATTRIBUTE, Hook.HYBRID_CONNECTOR,
             why="the one worker object given the host mirror's methods"),
    *(VllmName(CONNECTOR, f"NixlBaseConnector.{method}", Kind.FUNCTION, Hook.HYBRID_CONNECTOR, shape=shape,
               why=_HYBRID_WHY) for method, shape in (
        ("on_new_request", "self, request"),
        ("update_state_after_alloc", "self, request, blocks, num_external_tokens"),
        ("get_num_new_matched_tokens", "self, request, num_computed_tokens"),
        ("build_connector_meta", "self, scheduler_output"),
        ("request_finished", "self, request, block_ids"),
        ("request_finished_all_groups", "self, request, block_ids"),
        ("wait_for_save", "self"),
        ("register_kv_caches", "self, kv_caches"),
    )),
    VllmName("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1.bind_connector_metadata",
             Kind.FUNCTION, Hook.HYBRID_CONNECTOR, shape="self, connector_metadata", why=_HYBRID_WHY),
    VllmName(CONNECTOR, "NixlBaseConnector.wait_for_save", Kind.BRANCH, Hook.HYBRID_CONNECTOR,
             shape="self.connector_worker.save_kv_to_host", why="the copy out is looked up on the worker object"),
    VllmName(SCHEDULER, "NixlBaseConnectorScheduler._has_mamba", Kind.ATTRIBUTE, Hook.HYBRID_CONNECTOR,
             why="whole prompt and restore apply to models with recurrent layers only"),
    VllmName(SCHEDULER, "NixlBaseConnectorScheduler._truncate_request_for_prefill", Kind.FUNCTION,
             Hook.HYBRID_CONNECTOR, shape="self, request", versions=SINCE_0_31,
             why="the prefill-side truncation whole_prompt.py skips (prefill_backoff tells this release by it)"),
    VllmName(SCHEDULER, "NixlBaseConnectorScheduler._prefill_backoff", Kind.FUNCTION, Hook.HYBRID_CONNECTOR,
             shape="self", versions=SINCE_0_31, why="the prompt tokens kept off a prefill engine (prefill_backoff)"),
    VllmName(SCHEDULER, "NixlBaseConnectorScheduler._truncate_mamba_request_for_prefill", Kind.FUNCTION,
             Hook.HYBRID_CONNECTOR, shape="self, request", versions=BEFORE_0_31,
             why="the prefill-side truncation whole_prompt.py skips, one token for recurrent layers"),
    *(VllmName(SCHEDULER, f"NixlBaseConnectorScheduler.{truncate}", Kind.BRANCH, Hook.HYBRID_CONNECTOR,
               shape="params.get('_p_side_truncated')", versions=versions,
               why="whole_prompt.keep_whole_prompt sets this guard so vLLM leaves the prompt whole")
      for truncate, versions in (("_truncate_request_for_prefill", SINCE_0_31),
                                 ("_truncate_mamba_request_for_prefill", BEFORE_0_31))),
    *(VllmName(SCHEDULER, "NixlBaseConnectorScheduler.on_new_request", Kind.BRANCH, Hook.HYBRID_CONNECTOR,
               shape=f"self.{truncate}", versions=versions,
               why="the truncation runs in on_new_request, after the hook's on_new_request has set the guard")
      for truncate, versions in (("_truncate_request_for_prefill", SINCE_0_31),
                                 ("_truncate_mamba_request_for_prefill", FROM_0_29_TO_0_31))),
    VllmName(f"{NIXL}.pull_scheduler", "NixlPullConnectorScheduler.get_num_new_matched_tokens", Kind.BRANCH,
             Hook.HYBRID_CONNECTOR, shape="self._truncate_mamba_request_for_prefill", versions=BEFORE_0_29,
             why="the truncation runs when the scheduler asks for matched tokens, after on_new_request set the guard"),
    VllmName(SCHEDULER, "NixlBaseConnectorScheduler._get_remote_prefill_token_count", Kind.FUNCTION,
             Hook.HYBRID_CONNECTOR, shape="self, num_prompt_tokens",
             why="a decode engine loads the prompt less the backoff: pd/kv.py maps a whole prompt onto it"),
    VllmName(f"{NIXL}.pull_scheduler", "NixlPullConnectorScheduler.get_num_new_matched_tokens", Kind.BRANCH,
             Hook.HYBRID_CONNECTOR, shape="self._get_remote_prefill_token_count",
             why="the decode side counts what it loads that way; restore_last's override loads the whole prompt"),
    VllmName("vllm.v1.core.sched.scheduler", "Scheduler._update_waiting_for_remote_kv", Kind.FUNCTION,
             Hook.HYBRID_CONNECTOR, shape="self, request", why=_RESTORE_WHY),
    VllmName("vllm.v1.core.sched.scheduler", "Scheduler._update_waiting_for_remote_kv", Kind.BRANCH,
             Hook.HYBRID_CONNECTOR, shape="request.num_tokens - 1",
             why="a wholly loaded prompt recomputes its last token, the step restore_last.py undoes"),
    *(VllmName(WORKER, f"NixlBaseConnectorWorker.{attribute}", Kind.ATTRIBUTE, Hook.HYBRID_CONNECTOR, why=_HOST_WHY)
      for attribute in ("use_host_buffer", "_has_mamba", "_logical_num_blocks", "_physical_blocks_per_logical_kv_block",
                        "kv_cache_layout", "host_xfer_buffers", "host_buffer_kv_cache_layout")),
    *(VllmName(WORKER, f"NixlBaseConnectorWorker.{method}", Kind.FUNCTION, Hook.HYBRID_CONNECTOR, shape=shape,
               why=f"{_HOST_WHY}: replaced on the worker object with these parameters")
      for method, shape in (("initialize_host_xfer_buffer", "self, kv_caches"), ("save_kv_to_host", "self, metadata"),
                            ("sync_recved_kv_to_device", "self, req_id, meta"),
                            ("_logical_to_kernel_block_ids", "self, block_ids, ratio"))),
    VllmName(WORKER, "NixlBaseConnectorWorker.register_kv_caches", Kind.BRANCH, Hook.HYBRID_CONNECTOR,
             shape="self.initialize_host_xfer_buffer", why="the host buffer is made through the worker object"),
    VllmName(WORKER, "NixlBaseConnectorWorker", Kind.BRANCH, Hook.HYBRID_CONNECTOR,
             shape="self.sync_recved_kv_to_device", why="the copy in after a pull is looked up on the worker object"),
    *(VllmName(f"{NIXL}.metadata", name, Kind.ATTRIBUTE, Hook.HYBRID_CONNECTOR, why=_HOST_WHY)
      for name in ("NixlConnectorMetadata.reqs_to_save", "ReqMeta.local_block_ids",
                   "ReqMeta.local_physical_block_ids")),
    *(VllmName("vllm.v1.core.sched.output", name, Kind.ATTRIBUTE, Hook.HYBRID_CONNECTOR, why=_RESTORE_WHY)
      for name in ("SchedulerOutput.scheduled_new_reqs", "SchedulerOutput.scheduled_cached_reqs",
                   "NewRequestData.req_id", "NewRequestData.block_ids", "NewRequestData.num_computed_tokens",
                   "CachedRequestData.req_ids")),
    *(VllmName("vllm.v1.request", f"Request.{name}", Kind.ATTRIBUTE, Hook.HYBRID_CONNECTOR,
               why="the hooks read a request's KV transfer params, prompt length and id")
      for name in ("kv_transfer_params", "num_prompt_tokens", "request_id")),
    VllmName("vllm.v1.kv_cache_interface", "MambaSpec", Kind.CLASS, Hook.HYBRID_CONNECTOR,
             why="tells a recurrent layer group from an attention one"),
    *(VllmName("vllm.v1.kv_cache_interface", name, Kind.ATTRIBUTE, Hook.HYBRID_CONNECTOR,
               why="the KV cache groups, their layers and block sizes, read to find the blocks a step writes")
      for name in ("KVCacheConfig.num_blocks", "KVCacheConfig.kv_cache_groups", "KVCacheGroupSpec.layer_names",
                   "KVCacheGroupSpec.kv_cache_spec", "KVCacheSpec.block_size", "KVCacheSpec.page_size_bytes",
                   "MambaSpec.mamba_cache_mode")),
)

SINCE_0_30 = VersionRange(since="0.30.0")  # the worker's transfer results with failed receives, by request
_INTEGRITY_WHY = "kv_integrity.py digests a prefill's blocks and checks a pull's (nixl_progress.NixlConnector)"
KV_INTEGRITY_NAMES = (
    VllmName(f"{NIXL}.metadata", "NixlConnectorMetadata.reqs_to_recv", Kind.ATTRIBUTE, Hook.KV_INTEGRITY,
             why="the pulls a step starts, whose blocks the worker checks once they land"),
    VllmName(f"{NIXL}.metadata", "ReqMeta.local_block_ids", Kind.ATTRIBUTE, Hook.KV_INTEGRITY,
             why="the blocks a pull writes, one list per KV cache group"),
    *(VllmName("vllm.distributed.kv_transfer.kv_connector.v1.base", name, Kind.CLASS, Hook.KV_INTEGRITY,
               versions=SINCE_0_30, why=why) for name, why in (
        ("KVConnectorWorkerMetadata", "the digests ride from worker to scheduler as one (DigestReport)"),
        ("KVConnectorTransferResults", "a pull whose blocks differ is added to its failed_recving"))),
    *(VllmName("vllm.distributed.kv_transfer.kv_connector.v1.base", f"KVConnectorBase_V1.{method}", Kind.FUNCTION,
               Hook.KV_INTEGRITY, shape=shape, versions=SINCE_0_30, why=_INTEGRITY_WHY) for method, shape in (
        ("build_connector_worker_meta", "self"), ("get_transfer_results", "self, finished_req_ids"),
        ("update_connector_output", "self, connector_output"))),
    VllmName("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1._kv_cache_manager",
             Kind.ATTRIBUTE, Hook.KV_INTEGRITY, versions=SINCE_0_30,
             why="the block ids of a prefill whose prompt a step ends, digested after that step's forward"),
    VllmName("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", Kind.BRANCH, Hook.KV_INTEGRITY,
             shape="self._update_from_kv_xfer_finished(kv_connector_output)", versions=SINCE_0_30,
             why="the step's worker output reaches the connector after request_finished: the reply waits for it"),
    VllmName("vllm.v1.core.sched.scheduler", "Scheduler._handle_failed_recving", Kind.BRANCH, Hook.KV_INTEGRITY,
             shape="self.failed_recving_kv_req_ids.add(req_id)", versions=SINCE_0_30,
             why="a failed pull under the recompute policy is computed again from its first token"),
    *(VllmName("vllm.v1.kv_cache_interface", f"MambaSpec.{name}", Kind.ATTRIBUTE, Hook.KV_INTEGRITY,
               why="a recurrent state's bytes at the start of its padded page: what NIXL moves and the digest covers")
      for name in ("shapes", "dtypes")),
    *(VllmName(WORKER, f"NixlBaseConnectorWorker.{name}", Kind.ATTRIBUTE, Hook.KV_INTEGRITY,
               why="the prefill side digests the buffer NIXL reads: the host buffer where KV is staged there")
      for name in ("use_host_buffer", "host_xfer_buffers")),
    VllmName(WORKER, "NixlBaseConnectorWorker.tp_rank", Kind.ATTRIBUTE, Hook.KV_INTEGRITY,
             why="each tensor-parallel rank digests and checks its own part of the heads"),
    VllmName("vllm.v1.core.sched.output", "SchedulerOutput.num_scheduled_tokens", Kind.ATTRIBUTE, Hook.KV_INTEGRITY,
             why="which prefills a step ends"),
    *(VllmName("vllm.v1.request", f"Request.{name}", Kind.ATTRIBUTE, Hook.KV_INTEGRITY,
               why="which prefills a step ends") for name in ("num_computed_tokens", "num_prompt_tokens")),
)

FIRST_TOKEN_NAMES = (
    *(VllmName(LOGITS_PROCESSOR, name, Kind.NAME, Hook.FIRST_TOKEN, versions=V1_ONLY,
               why="FirstTokenProcessor implements vLLM's V1 logits-processor interface")
      for name in ("LogitsProcessor", "BatchUpdate")),
    *(VllmName(f"{LOGITS_PROCESSOR}.interface", f"LogitsProcessor.{method}", Kind.FUNCTION, Hook.FIRST_TOKEN,
               shape=shape, versions=V1_ONLY, why="FirstTokenProcessor implements it")
      for method, shape in (("__init__", "self, vllm_config, device, is_pin_memory"),
                            ("validate_params", "cls, sampling_params"), ("is_argmax_invariant", "self"),
                            ("update_state", "self, batch_update"), ("apply", "self, logits"))),
    VllmName(f"{LOGITS_PROCESSOR}.builtin", "process_dict_updates", Kind.FUNCTION, Hook.FIRST_TOKEN,
             shape="req_entries, batch_update, new_state", versions=V1_ONLY,
             why="update_state keeps its rows with it"),
    VllmName("vllm.sampling_params", "SamplingParams.extra_args", Kind.ATTRIBUTE, Hook.FIRST_TOKEN,
             why="the first token arrives in the request's vllm_xargs, kept as extra_args"),
    VllmName("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest", Kind.BRANCH,
             Hook.FIRST_TOKEN, shape="self.vllm_xargs", why="a chat request's vllm_xargs become its extra_args"),
    VllmName("vllm", "SamplingParams", Kind.NAME, Hook.FIRST_TOKEN, why="imported from vllm"),
    VllmName("vllm.config", "VllmConfig", Kind.NAME, Hook.FIRST_TOKEN, why="imported from vllm.config"),
)

_SIDE_CHANNEL_WHY = "side_channel.py puts a keyed listener where vLLM opens its NIXL side channel"
SIDE_CHANNEL_NAMES = (
    VllmName(f"{NIXL}.utils", "zmq_ctx", Kind.FUNCTION, Hook.SIDE_CHANNEL, shape="socket_type, addr",
             why=_SIDE_CHANNEL_WHY),
    *(VllmName(module, "zmq_ctx", Kind.NAME, Hook.SIDE_CHANNEL, shape=f"from {NIXL}.utils",
               why=f"{_SIDE_CHANNEL_WHY}: the name is replaced where each module imported it")
      for module in (SCHEDULER, WORKER)),
    VllmName(SCHEDULER, "NixlBaseConnectorScheduler._nixl_handshake_listener", Kind.FUNCTION, Hook.SIDE_CHANNEL,
             shape="encoded_data, ready_event, stop_event, host, port", why=_SIDE_CHANNEL_WHY),
    VllmName(SCHEDULER, "NixlBaseConnectorScheduler._nixl_handshake_listener", Kind.BRANCH, Hook.SIDE_CHANNEL,
             shape="zmq_ctx(zmq.ROUTER, path)", why="the listener opens its socket through zmq_ctx"),
    VllmName(SCHEDULER, "NixlBaseConnectorScheduler._nixl_handshake_listener", Kind.BRANCH, Hook.SIDE_CHANNEL,
             shape="msgspec.msgpack.decode(msg)", why="keep_listening restarts it after the errors this decode raises"),
    VllmName(WORKER, "NixlBaseConnectorWorker._nixl_handshake", Kind.BRANCH, Hook.SIDE_CHANNEL,
             shape="zmq_ctx(zmq.REQ, path)", why="the handshake's client socket comes from zmq_ctx too"),
    VllmName("vllm.utils.network_utils", "make_zmq_socket", Kind.FUNCTION, Hook.SIDE_CHANNEL,
             shape="ctx, path, socket_type, bind, ...",
             why="keyed_zmq_ctx makes its socket with it, as vLLM's zmq_ctx does"),
)

ENGINE_KEY_NAMES = (
    VllmName("vllm.entrypoints.openai.cli_args", "FrontendArgs.middleware", Kind.ATTRIBUTE, Hook.ENGINE_KEY,
             versions=BEFORE_0_29, why="engine_key.py's guard is loaded with --middleware"),
    *(VllmName("vllm.entrypoints.openai.api_server", "build_app", Kind.BRANCH, Hook.ENGINE_KEY, shape=shape,
               versions=BEFORE_0_29, why="vLLM adds each --middleware class last, so it runs before vLLM's own guard")
      for shape in ("args.middleware", "app.add_middleware(imported)")),
    VllmName("vllm.entrypoints.launchers.cli_args", "FrontendArgs.middleware", Kind.ATTRIBUTE, Hook.ENGINE_KEY,
             versions=VersionRange(since="0.29.0", before="0.33.0"),
             why="engine_key.py's guard is loaded with --middleware"),
    VllmName("vllm.entrypoints.common.cli_args", "FrontendArgs.middleware", Kind.ATTRIBUTE, Hook.ENGINE_KEY,
             versions=VersionRange(since="0.33.0"), why="engine_key.py's guard is loaded with --middleware"),
    *(VllmName("vllm.entrypoints.serve.middleware.register", "init_entrypoints_middleware", Kind.BRANCH,
               Hook.ENGINE_KEY, shape=shape, versions=VersionRange(since="0.29.0"),
               why="vLLM adds each --middleware class last, so it runs before vLLM's own guard")
      for shape in ("args.middleware", "app.add_middleware(imported)")),
)

# What pdserve sets in an engine's environment (engines/command.py, model_layout.py, engine_key.py): vLLM ignores a
# variable it no longer reads, so a renamed one would silently undo the setting.
COMMAND_NAMES = (
    *(VllmName("vllm.envs", variable, Kind.ENV, Hook.COMMAND, why="pdserve sets it in an engine's environment")
      for variable in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_AOT_COMPILE", "VLLM_WORKER_MULTIPROC_METHOD",
                       "VLLM_CACHE_ROOT", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_HOST_IP",
                       "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_SSM_CONV_STATE_LAYOUT",
                       "VLLM_API_KEY")),
    VllmName("vllm.envs", "VLLM_USE_V2_MODEL_RUNNER", Kind.ENV, Hook.COMMAND, versions=V1_ONLY,
             why="kv.cross_layer_blocks asks for Model Runner V1 with it (LIMITS: gone in 0.34)"),
)

CONTRACT: tuple[VllmName, ...] = (ENGINE_SERVER_NAMES + NIXL_PROGRESS_NAMES + HYBRID_CONNECTOR_NAMES
                                  + KV_INTEGRITY_NAMES + FIRST_TOKEN_NAMES + SIDE_CHANNEL_NAMES + ENGINE_KEY_NAMES + COMMAND_NAMES)

LIMITS = (
    Limit(Feature.FIRST_TOKEN, Hook.FIRST_TOKEN, V2_ONLY,
          reason="vLLM 0.34 removed the V1 logits-processor interface (vllm/v1/sample/logits_processor/) that "
                 "FirstTokenProcessor implements; only Model Runner V2's remains",
          instead="prefill.first_token_processor: false and decode.first_token_processor: false"),
    Limit(Feature.CROSS_LAYER_BLOCKS, Hook.COMMAND, V2_ONLY,
          reason="vLLM 0.34 removed Model Runner V1, which cross-layer blocks ask for with VLLM_USE_V2_MODEL_RUNNER=0 "
                 "(vLLM refuses that value: platforms/interface.py, validate_environ); its NixlConnector has not read "
                 "enable_cross_layers_blocks since 0.26 (prefer_cross_layer_blocks)",
          instead="kv.cross_layer_blocks: off"),
)
