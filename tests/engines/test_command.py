from __future__ import annotations

import importlib
import inspect
import json
import logging
from typing import Any

import pytest

from pdserve.config import parse_settings
from pdserve.engine_key import EngineKey
from pdserve.engines.command import EngineCommand, build_engine_command, engine_environ, split_cpus
from pdserve.engines.kv_link import HostLink
from pdserve.engines.model_layout import Layout, ModelLayout
from pdserve.errors import ConfigError
from pdserve_vllm import ENGINE_KEY_ENV, FIRST_TOKEN_PROCESSOR, PROGRESS_DELAY_ENV

NO_RDMA = HostLink()


def engine_commands(tree: dict[str, object], *, link: HostLink = NO_RDMA,
                    layout: Layout = Layout.ATTENTION) -> list[EngineCommand]:
    settings = parse_settings(tree, source="t")
    return [build_engine_command(spec, model=settings.model, model_path="/m", kv=settings.kv,
                                 layout=ModelLayout("/m", layout, "test"),
                                 python="py", host="127.0.0.1", cpu_bind="0", link=link)
            for spec in settings.engine_specs()]


def commands(tree: dict[str, object]) -> list[tuple[list[str], dict[str, str]]]:
    return [(command.argv, command.env) for command in engine_commands(tree)]


def kv_config(command: EngineCommand) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(command.argv[command.argv.index("--kv-transfer-config") + 1])
    return config


def test_cpu_engines_get_nixl_roles_ids_side_channels_and_cpu_buffer() -> None:
    (prefill_argv, prefill_env), (decode_argv, decode_env) = commands({})
    prefill_kv = json.loads(prefill_argv[prefill_argv.index("--kv-transfer-config") + 1])
    decode_kv = json.loads(decode_argv[decode_argv.index("--kv-transfer-config") + 1])
    assert (prefill_kv["kv_role"], decode_kv["kv_role"]) == ("kv_producer", "kv_consumer")
    assert prefill_kv["engine_id"] != decode_kv["engine_id"]
    assert prefill_kv["kv_buffer_device"] == decode_kv["kv_buffer_device"] == "cpu"
    assert prefill_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != decode_env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert prefill_env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "CUDA_VISIBLE_DEVICES" not in prefill_env
    assert prefill_argv[:3] == ["py", "-m", "pdserve_vllm.engine_server"]  # vLLM's server, its engine core forked


def test_no_engine_follows_a_media_urls_redirect_to_a_host_the_gateway_did_not_check() -> None:
    for _argv, env in commands({}):
        assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"


def test_gpu_engines_are_pinned_and_read_over_cuda_ipc() -> None:
    tree = {"prefill": {"base_port": 8100, "device": "cuda", "gpu_ids": [0, 1], "tensor_parallel_size": 2},
            "decode": {"base_port": 8200, "device": "cuda", "gpu_ids": [2], "extra_args": ["--enforce-eager"]}}
    (prefill_argv, prefill_env), (decode_argv, decode_env) = commands(tree)
    assert prefill_env["CUDA_VISIBLE_DEVICES"] == "0,1" and decode_env["CUDA_VISIBLE_DEVICES"] == "2"
    assert prefill_argv[prefill_argv.index("--tensor-parallel-size") + 1] == "2"
    assert decode_env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    assert prefill_argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # vLLM's own start on GPUs
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


def test_every_engine_takes_vllms_connector_from_pdserves_module_and_cpu_engines_pause_nixls_progress_thread() -> None:
    """The module keys the side channel (pdserve_vllm/side_channel.py) on every engine; the pause is where set."""
    def pauses(tree: dict[str, object]) -> list[tuple[str | None, str | None]]:
        return [(kv_config(command).get("kv_connector_module_path"), command.env.get(PROGRESS_DELAY_ENV))
                for command in engine_commands(tree)]

    plugin = "pdserve_vllm.nixl_progress"
    assert pauses({}) == [(plugin, "100")] * 2
    gpu = {"device": "cuda", "gpu_ids": [0]}
    assert pauses({"prefill": gpu, "decode": gpu}) == [(plugin, None)] * 2  # NIXL's own progress thread
    assert pauses({"kv": {"progress_delay_us": 0}}) == [(plugin, None)] * 2
    assert pauses({"prefill": gpu, "decode": gpu, "kv": {"progress_delay_us": 50}}) == [(plugin, "50")] * 2
    assert all(kv_config(command)["kv_connector"] == "NixlConnector" for command in engine_commands({}))


def test_a_hybrids_engines_take_the_connector_that_keeps_whole_prompts_and_mirrors_host_staged_pages() -> None:
    def modules(tree: dict[str, object], layout: Layout) -> list[str | None]:
        return [kv_config(command).get("kv_connector_module_path") for command in engine_commands(tree, layout=layout)]

    host_staged = {"device": "cuda", "gpu_ids": [0]}
    tree = {"prefill": host_staged, "decode": host_staged, "kv": {"buffer_device": "cpu"}}
    assert modules(tree, Layout.HYBRID) == ["pdserve_vllm.hybrid_connector"] * 2
    # vLLM's own host buffer works for attention layers
    assert modules(tree, Layout.ATTENTION) == ["pdserve_vllm.nixl_progress"] * 2
    assert modules({"prefill": host_staged, "decode": host_staged, "kv": {"buffer_device": "cuda"}},
                   Layout.HYBRID) == ["pdserve_vllm.hybrid_connector"] * 2
    assert modules({}, Layout.HYBRID) == ["pdserve_vllm.hybrid_connector"] * 2  # it pauses NIXL's progress too
    assert modules({}, Layout.ATTENTION) == ["pdserve_vllm.nixl_progress"] * 2


def test_cpu_engines_run_the_model_in_the_engine_core_on_threads_for_their_cores() -> None:
    def executor(argv: list[str]) -> str | None:
        flags = [index for index, arg in enumerate(argv) if arg == "--distributed-executor-backend"]
        return argv[flags[-1] + 1] if flags else None  # argparse keeps the last

    (prefill_argv, prefill_env), _ = commands({})
    assert executor(prefill_argv) == "uni" and prefill_env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert prefill_env["VLLM_USE_AOT_COMPILE"] == "0" and prefill_env["OMP_NUM_THREADS"] == "1"  # cpu_bind "0"
    (own_argv, own_env), _ = commands({"prefill": {"extra_args": ["--distributed-executor-backend", "mp"],
                                                   "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}})
    assert executor(own_argv) == "mp" and own_env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    (gpu_argv, gpu_env), _ = commands({"prefill": {"device": "cuda", "gpu_ids": [0]}})
    assert executor(gpu_argv) is None and "OMP_NUM_THREADS" not in gpu_env and "VLLM_USE_AOT_COMPILE" not in gpu_env
    (tp_argv, _env), _ = commands({"prefill": {"tensor_parallel_size": 2}})
    assert executor(tp_argv) is None  # two workers need vLLM's own multiprocess executor


def test_split_cpus_gives_each_engine_its_own_cores() -> None:
    assert split_cpus([0, 1], 2) == ["0", "1"]
    assert split_cpus([0, 1, 2, 3, 4], 2) == ["0,1", "2,3"]
    assert split_cpus([3], 2) == ["3", "3"]


def test_cpu_engines_over_libfabric_pin_the_tcp_provider_and_log_why() -> None:
    for command in engine_commands({"kv": {"backends": ["LIBFABRIC"]}}):
        assert command.env["FI_PROVIDER"] == "tcp" and "FI_EFA_FORK_SAFE" not in command.env
        assert kv_config(command)["kv_connector_extra_config"] == {"backends": ["LIBFABRIC"]}
        assert kv_config(command)["kv_buffer_device"] == "cpu"
        assert command.notes == ("kv buffer cpu: CPU engine", "libfabric provider tcp: no EFA device on this host")
    (ucx, _decode) = engine_commands({})
    assert "NIXL_LOG_LEVEL" not in ucx.env  # only LIBFABRIC's provider line needs NIXL's INFO logs
    assert "FI_PROVIDER" not in ucx.env and ucx.notes == ("kv buffer cpu: CPU engine",)


def test_gpu_engines_on_efa_without_gpudirect_stage_kv_through_host_memory() -> None:
    l4 = {"device": "cuda", "gpu_ids": [0], "placement": {"efa_devices": 1}}
    tree = {"prefill": l4, "decode": l4, "kv": {"backends": ["LIBFABRIC"]}}
    for command in engine_commands(tree, link=HostLink(efa_devices=("rdmap0",))):
        assert kv_config(command)["kv_buffer_device"] == "cpu"
        assert command.env["FI_PROVIDER"] == "efa" and "FI_EFA_USE_DEVICE_RDMA" not in command.env
        assert command.env["NIXL_LOG_LEVEL"] == "INFO"  # prints the provider NIXL opened
        assert command.notes[0] == "kv buffer cpu: EFA without GPUDirect RDMA (no peermem module loaded)"
    for command in engine_commands(tree, link=HostLink(efa_devices=("rdmap0",), has_peermem=True)):
        assert kv_config(command)["kv_buffer_device"] == "cuda" and "FI_EFA_USE_DEVICE_RDMA" not in command.env


def test_a_provider_pinned_in_the_pool_env_is_the_one_logged() -> None:
    tree = {"kv": {"backends": ["LIBFABRIC"]}, "decode": {"env": {"FI_PROVIDER": "shm"}}}
    prefill, decode = engine_commands(tree)
    assert prefill.notes[1] == "libfabric provider tcp: no EFA device on this host"
    assert decode.env["FI_PROVIDER"] == "shm" and decode.notes[1] == "libfabric provider shm: set in the pool env"


def test_an_otlp_endpoint_makes_each_engine_export_its_spans_there_over_http() -> None:
    settings = parse_settings({}, source="t")

    def command(endpoint: str) -> EngineCommand:
        return build_engine_command(settings.engine_specs()[0], model=settings.model, model_path="/m", kv=settings.kv,
                                    layout=ModelLayout("/m", Layout.ATTENTION, "test"), python="py", host="127.0.0.1",
                                    cpu_bind="0", link=NO_RDMA, otlp_traces_endpoint=endpoint)

    traced, untraced = command("http://collector:4318/v1/traces"), command("")
    assert traced.argv[traced.argv.index("--otlp-traces-endpoint") + 1] == "http://collector:4318/v1/traces"
    assert traced.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"  # vLLM would speak gRPC
    assert "--otlp-traces-endpoint" not in untraced.argv and "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in untraced.env


def test_typed_gpu_memory_settings_become_vllm_flags_and_cpu_pools_refuse_a_gpu_share() -> None:
    l4 = {"device": "cuda", "gpu_ids": [0], "gpu_memory_utilization": 0.9, "enforce_eager": True}
    for argv, _env in commands({"prefill": l4, "decode": {**l4, "base_port": 8200}}):
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9" and "--enforce-eager" in argv
    for argv, _env in commands({"prefill": {"device": "cuda", "gpu_ids": [0]}, "decode": {}}):
        assert "--gpu-memory-utilization" not in argv and "--enforce-eager" not in argv  # vLLM's own defaults
    with pytest.raises(ConfigError, match=r"prefill: Value error, gpu_memory_utilization is for device: cuda"):
        parse_settings({"prefill": {"gpu_memory_utilization": 0.5}}, source="t")


def test_launch_cache_dir_is_where_each_engine_keeps_its_compiled_model() -> None:
    settings = parse_settings({"launch": {"cache_dir": "/var/cache/pdserve-vllm"}}, source="t")
    spec = settings.engine_specs()[0]
    command = build_engine_command(spec, model=settings.model, model_path="/m", kv=settings.kv,
                                   layout=ModelLayout("/m", Layout.ATTENTION, "test"), python="py", host="127.0.0.1",
                                   cpu_bind="0", link=NO_RDMA, compile_cache_dir=settings.launch.cache_dir)
    assert command.env["VLLM_CACHE_ROOT"] == "/var/cache/pdserve-vllm"
    assert all("VLLM_CACHE_ROOT" not in env for _argv, env in commands({}))  # vLLM's own ~/.cache/vllm


def test_cross_layer_kv_blocks_where_vllm_allows_them_and_both_engines_agree() -> None:
    gpu = {"device": "cuda", "gpu_ids": [0]}
    settings = parse_settings({"prefill": gpu, "decode": {**gpu, "base_port": 8200}}, source="t")

    def built(layout: Layout, *, link: HostLink = NO_RDMA, kv: dict[str, object] | None = None) -> list[EngineCommand]:
        tuned = parse_settings({"prefill": gpu, "decode": {**gpu, "base_port": 8200}, "kv": kv or {}}, source="t")
        return [build_engine_command(spec, model=tuned.model, model_path="/m", kv=tuned.kv,
                                     layout=ModelLayout("/m", layout, "test"), python="py", host="127.0.0.1",
                                     cpu_bind="0", link=link) for spec in tuned.engine_specs()]

    assert len(settings.engine_specs()) == 2
    dense = built(Layout.ATTENTION)  # UCX with cuda transports: the KV buffer stays in GPU memory
    assert all(kv_config(command)["kv_connector_extra_config"]["enable_cross_layers_blocks"] is True
               for command in dense)
    assert all(command.env["VLLM_USE_V2_MODEL_RUNNER"] == "0" for command in dense)
    for command in (*built(Layout.HYBRID), *built(Layout.ATTENTION, link=HostLink(ucx_has_cuda=False)),
                    *built(Layout.ATTENTION, kv={"cross_layer_blocks": "off"})):
        assert "enable_cross_layers_blocks" not in kv_config(command)["kv_connector_extra_config"]
        assert "VLLM_USE_V2_MODEL_RUNNER" not in command.env
    with pytest.raises(ConfigError, match="kv.cross_layer_blocks: on needs GPU engines with the KV buffer in GPU"):
        built(Layout.HYBRID, kv={"cross_layer_blocks": "on"})
    assert all("enable_cross_layers_blocks" not in kv_config(command)["kv_connector_extra_config"]
               for command in engine_commands({}))  # CPU engines


def test_engines_load_the_first_token_processor_unless_their_args_rule_it_out() -> None:
    (prefill_argv, _), (decode_argv, _) = commands(
        {"decode": {"extra_args": ["--speculative-config={\"method\": \"ngram\"}"]}})
    assert prefill_argv[prefill_argv.index("--logits-processors") + 1] == FIRST_TOKEN_PROCESSOR
    assert "--logits-processors" not in decode_argv  # vLLM refuses custom logits processors with speculative decoding
    assert parse_settings({"decode": {"extra_args": ["--logits-processors", "m:C"]}}, source="t").decode.forces_first_token is False


def test_the_engine_key_is_in_each_engines_env_for_pdserve_and_vllm_never_its_argv_and_no_pool_env_replaces_it() -> None:
    key = EngineKey("engine-key-0123456789abcdef")
    settings = parse_settings({"prefill": {"env": {"VLLM_API_KEY": "pool-key-0123456789", ENGINE_KEY_ENV: "x"}}},
                              source="t")
    for spec in settings.engine_specs():
        command = build_engine_command(spec, model=settings.model, model_path="/m", kv=settings.kv,
                                       layout=ModelLayout("/m", Layout.ATTENTION, "test"), python="py",
                                       host="127.0.0.1", cpu_bind="0", link=NO_RDMA, engine_key=key)
        assert command.env[ENGINE_KEY_ENV] == command.env["VLLM_API_KEY"] == key.value, spec.name
        assert not any(key.value in arg for arg in command.argv) and key.value not in repr(command)


def test_an_engine_inherits_no_pdserve_variable_of_its_parent_only_what_its_command_sets() -> None:
    parent = {"PATH": "/usr/bin", "PDSERVE_API_KEYS": "client-key-0123456789", "PDSERVE_ADMIN_KEY": "admin-key-0123456",
              "PDSERVE_GATEWAY__PORT": "9000", ENGINE_KEY_ENV: "a-parent-s-own-key-0123"}
    command = EngineCommand(["python"], {ENGINE_KEY_ENV: "the-deployment-key-0123", "OMP_NUM_THREADS": "2"})
    assert engine_environ(parent, command) == {"PATH": "/usr/bin", ENGINE_KEY_ENV: "the-deployment-key-0123",
                                               "OMP_NUM_THREADS": "2"}


def test_every_engine_requires_the_engine_key_on_every_route_and_keeps_nixl_on_its_own_interface() -> None:
    for command in engine_commands({}) + engine_commands({"prefill": {"device": "cuda", "gpu_ids": [0]}}):
        middleware = command.argv[command.argv.index("--middleware") + 1]
        module_path, name = middleware.rsplit(".", 1)  # as vLLM resolves it (serve/middleware/register.py)
        assert inspect.isclass(getattr(importlib.import_module(module_path), name))
        assert command.env["UCX_NET_DEVICES"] == "lo"  # the engines' address, 127.0.0.1, is loopback's


def test_engines_leave_the_gateways_polls_out_of_their_access_log_and_keep_client_requests() -> None:
    """A restarted engine's last log lines were the gateway's polls (~7 GET /metrics and /health a second).
    vLLM 0.32's narrowest switch: --disable-access-log-for-endpoints (entrypoints/launchers/cli_args.py), whose
    filter drops exactly the paths listed (logging_utils/uvicorn_logging.py), not --disable-uvicorn-access-log."""
    for argv, _ in commands({}):
        assert argv[argv.index("--disable-access-log-for-endpoints") + 1] == "/health,/metrics"
        assert "--disable-uvicorn-access-log" not in argv
    from vllm.logging_utils.uvicorn_logging import UvicornAccessLogFilter

    def record(path: str) -> logging.LogRecord:  # as uvicorn's access logger writes one
        return logging.LogRecord("uvicorn.access", logging.INFO, "h11_impl.py", 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    kept = UvicornAccessLogFilter(excluded_paths=["/health", "/metrics"])
    assert not kept.filter(record("/metrics")) and not kept.filter(record("/health"))
    assert kept.filter(record("/v1/chat/completions")) and kept.filter(record("/v1/models"))
