"""A stand-in for vLLM 0.26's OpenAI server whose engine core fails to start: it writes what the real
server writes to its log in that failure, then exits 1 as the real one does. Run as a script with the
case: ``python vllm_start_failure.py mamba-blocks`` or ``host-buffer``.

What vLLM writes, in order (vLLM 0.26 source, as staged for the GPU runs):
1. The engine core process logs the exception: ``logger.exception("EngineCore failed to start.")`` in
   ``run_engine_core`` (vllm/v1/engine/core.py:1330). vLLM's log format is "LEVEL MM-DD HH:MM:SS
   [file:line] message" (vllm/logger.py, _FORMAT), and its NewLineFormatter repeats that prefix on every
   line of the traceback, joining lines with "\\r\\n" (vllm/logging_utils/formatter.py). The engine core's
   stdout and stderr carry "(EngineCore pid=N) " on every line (decorate_logs, _add_prefix in
   vllm/utils/system_utils.py; process title "EngineCore" without data parallelism, core.py:1269).
2. ``run_engine_core`` re-raises (``raise e``, core.py:1334) and Python's multiprocessing prints
   "Process EngineCore:" and the traceback again on the (prefixed) stderr (BaseProcess._bootstrap).
3. The API server, waiting in ``wait_for_engine_startup``, raises RuntimeError "Engine core initialization
   failed. See root cause above. Failed core proc(s): {}" (vllm/v1/engine/utils.py:1272); uncaught, its
   traceback goes to stderr with "(APIServer pid=N) " (decorate_logs("APIServer"),
   vllm/entrypoints/openai/api_server.py:749) and the interpreter exits 1.
Frames, line numbers and source lines are vLLM 0.26's (files under /tmp/site, where the GPU runs unpack it).
"""

from __future__ import annotations

import sys

SITE = "/tmp/site"
ENGINE_PID, SERVER_PID = 2412, 2301
LOG_PREFIX = "ERROR 12-06 01:52:07 [core.py:1330] "

# Each frame: (file under SITE, line, function, source line), outermost first.
ENGINE_CORE_FRAMES = [
    ("vllm/v1/engine/core.py", 1299, "run_engine_core", "engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)"),
    ("vllm/tracing/otel.py", 178, "sync_wrapper", "return func(*args, **kwargs)"),  # @instrument, core.py:1001
    ("vllm/v1/engine/core.py", 1065, "__init__", "super().__init__("),
    ("vllm/v1/engine/core.py", 136, "__init__", "kv_cache_config = self._initialize_kv_caches(vllm_config)"),
    ("vllm/tracing/otel.py", 178, "sync_wrapper", "return func(*args, **kwargs)"),  # @instrument, core.py:242
    ("vllm/v1/engine/core.py", 324, "_initialize_kv_caches", "self.model_executor.initialize_from_config(kv_cache_configs)"),
    ("vllm/v1/executor/abstract.py", 123, "initialize_from_config",
     'self.collective_rpc("initialize_from_config", args=(kv_cache_configs,))'),
    ("vllm/v1/executor/uniproc_executor.py", 92, "collective_rpc",
     "result = run_method(self.driver_worker, method, args, kwargs)"),
    ("vllm/v1/serial_utils.py", 510, "run_method", "return func(*args, **kwargs)"),
    ("vllm/v1/worker/worker_base.py", 325, "initialize_from_config",
     "self.worker.initialize_from_config(kv_cache_config)  # type: ignore"),
    ("vllm/v1/worker/gpu_worker.py", 732, "initialize_from_config", "self.model_runner.initialize_kv_cache(kv_cache_config)"),
]
CASES = {
    # A hybrid model whose capped KV cache holds fewer Mamba blocks than max_num_seqs, with full decode CUDA
    # graphs (vllm/config/compilation.py:1491, resolve_cudagraph_mode_and_sizes; the message is vLLM's).
    "mamba-blocks": (
        [("vllm/v1/worker/gpu_model_runner.py", 7578, "initialize_kv_cache",
          "self.initialize_attn_backend(kv_cache_config, is_profiling=is_profiling)"),
         ("vllm/v1/worker/gpu_model_runner.py", 7042, "initialize_attn_backend", "self._check_and_update_cudagraph_mode("),
         ("vllm/v1/worker/gpu_model_runner.py", 7115, "_check_and_update_cudagraph_mode",
          "cudagraph_mode = self.compilation_config.resolve_cudagraph_mode_and_sizes("),
         ("vllm/config/compilation.py", 1491, "resolve_cudagraph_mode_and_sizes", "raise ValueError(")],
        ("ValueError: max_num_seqs (1024) exceeds available Mamba cache blocks (614). Each decode sequence requires "
        "one Mamba cache block, so CUDA graph capture cannot proceed. Please lower max_num_seqs to at most 614 or "
        "increase gpu_memory_utilization."),
    ),
    # kv_buffer_device "cpu" with a hybrid model: a Mamba layer's cache is a list of state tensors, and the
    # host buffer reads .shape of every layer's (nixl/base_worker.py:742, initialize_host_xfer_buffer).
    "host-buffer": (
        [("vllm/v1/worker/gpu_model_runner.py", 7618, "initialize_kv_cache", "kv_transfer_group.register_kv_caches(kv_caches)"),
         ("vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py", 228, "register_kv_caches",
          "self.connector_worker.register_kv_caches(kv_caches)"),
         ("vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py", 1060, "register_kv_caches",
          "self.initialize_host_xfer_buffer(kv_caches=kv_caches)"),
         ("vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py", 742, "initialize_host_xfer_buffer",
          "kv_shape = kv_cache.shape")],
        "AttributeError: 'list' object has no attribute 'shape'",
    ),
}
# The API server's side: vllm/entrypoints/openai/api_server.py:799 down to vllm/v1/engine/utils.py:1272
# (runpy's, uvloop's and contextlib's frames as Python 3.12 and uvloop print them; their line numbers unchecked).
SERVER_FRAMES = [
    ("<frozen runpy>", 198, "_run_module_as_main", ""),
    ("<frozen runpy>", 88, "_run_code", ""),
    ("vllm/entrypoints/openai/api_server.py", 799, "<module>", "uvloop.run(run_server(args))"),
    ("uvloop/__init__.py", 96, "run", "return __asyncio.run("),
    ("vllm/entrypoints/openai/api_server.py", 759, "run_server", "await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)"),
    ("vllm/entrypoints/openai/api_server.py", 773, "run_server_worker", "async with build_async_engine_client("),
    ("vllm/entrypoints/openai/api_server.py", 139, "build_async_engine_client", "async with build_async_engine_client_from_engine_args("),
    ("vllm/entrypoints/openai/api_server.py", 175, "build_async_engine_client_from_engine_args",
     "async_llm = AsyncLLM.from_vllm_config("),
    ("vllm/v1/engine/async_llm.py", 217, "from_vllm_config", "return cls("),
    ("vllm/v1/engine/async_llm.py", 146, "__init__", "self.engine_core = EngineCoreClient.make_async_mp_client("),
    ("vllm/v1/engine/core_client.py", 132, "make_async_mp_client", "return AsyncMPClient(*client_args)"),
    ("vllm/v1/engine/core_client.py", 963, "__init__", "super().__init__("),
    ("vllm/v1/engine/core_client.py", 573, "__init__", "with launch_core_engines("),
    ("/usr/lib/python3.12/contextlib.py", 144, "__exit__", "next(self.gen)"),
    ("vllm/v1/engine/utils.py", 1213, "launch_core_engines", "wait_for_engine_startup("),
    ("vllm/v1/engine/utils.py", 1272, "wait_for_engine_startup", "raise RuntimeError("),
]
SERVER_ERROR = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"


def traceback_lines(frames: list[tuple[str, int, str, str]], exception: str) -> list[str]:
    """Python's traceback text for ``frames`` (outermost first) ending in ``exception``."""
    lines = ["Traceback (most recent call last):"]
    for path, line, function, source in frames:
        where = path if path.startswith(("<", "/")) else f"{SITE}/{path}"
        lines.append(f'  File "{where}", line {line}, in {function}')
        if source:
            lines.append(f"    {source}")
    return [*lines, exception]


def main(case: str) -> int:
    failing_frames, exception = CASES[case]
    frames = ENGINE_CORE_FRAMES + failing_frames
    out = sys.stdout
    out.write(f"(EngineCore pid={ENGINE_PID}) INFO 12-06 01:51:20 [core.py:116] Initializing a V1 LLM engine "
              "(v0.26.0) with config: model='/tmp/qwen3.5-9b'\n")  # core.py:116-120
    logged = ["EngineCore failed to start.", *traceback_lines(frames, exception)]
    out.write("\r\n".join(f"(EngineCore pid={ENGINE_PID}) {LOG_PREFIX}{line}" for line in logged) + "\n")
    reraised = [("/usr/lib/python3.12/multiprocessing/process.py", 314, "_bootstrap", "self.run()"),
                ("/usr/lib/python3.12/multiprocessing/process.py", 108, "run", "self._target(*self._args, **self._kwargs)"),
                ("vllm/v1/engine/core.py", 1334, "run_engine_core", "raise e"), *frames]
    for line in ["Process EngineCore:", *traceback_lines(reraised, exception)]:
        out.write(f"(EngineCore pid={ENGINE_PID}) {line}\n")
    for line in traceback_lines(SERVER_FRAMES, SERVER_ERROR):
        out.write(f"(APIServer pid={SERVER_PID}) {line}\n")
    out.flush()
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
