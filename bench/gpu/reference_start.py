"""Does Ray Serve LLM's own PD app start with both engines on one GPU? Deploys ``build_pd_openai_app`` on the
running local Ray cluster (``reference_h200.sh`` starts it) as its users would write it for a shared GPU, waits
at most --timeout-s printing each deployment's state every 10 s, sends one chat completion, and writes what
happened to --out (JSON). Run with the vLLM stage on PYTHONPATH (Ray 2.58, vLLM 0.26).

The settings follow Ray Serve LLM's fractional-GPU guide (doc/source/serve/llm/user-guides/fractional-gpu.md):
a placement bundle of a GPU fraction and the same fraction in VLLM_RAY_PER_WORKER_GPUS, which vLLM's Ray
executor asks each worker for (vllm/envs.py, default 1.0). Ray 2.58 computes that variable from the bundle
but passes it only to helper tasks, not to the replica that starts the engine (ray-project/ray#63875), so
it goes in each LLMConfig's runtime_env here. Ray Serve LLM refuses any executor but Ray's on GPUs
(vllm_models.py: "distributed_executor_backend != 'ray' is not allowed").
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

GPU_SHARE = 0.45
POLL_S = 10.0


def engine(name: str, *, model_dir: str, served_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One LLMConfig: the engine settings pdserve's GPU scripts give vLLM (bench/gpu/pd_config.sh), a GPU share;
    ``--batching-interval-ms`` sets Ray Serve LLM's stream batching (its docs' experimental_configs key)."""
    config: dict[str, Any] = {
        "model_loading_config": {"model_id": served_name, "model_source": model_dir},
        "engine_kwargs": {
            "max_model_len": args.max_model_len, "dtype": "bfloat16", "load_format": "dummy",
            "gpu_memory_utilization": args.gpu_memory_utilization, "kv_cache_memory_bytes": args.kv_bytes,
            "block_size": 128, "enforce_eager": args.eager,
            "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": name},
        },
        "placement_group_config": {"bundles": [{"GPU": GPU_SHARE, "CPU": 1}]},
        "deployment_config": {"num_replicas": 1},
        "runtime_env": {"env_vars": {"VLLM_RAY_PER_WORKER_GPUS": str(GPU_SHARE), "VLLM_DISABLE_COMPILE_CACHE": "1",
                                     "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}},
    }
    if args.language_model_only:
        config["engine_kwargs"]["language_model_only"] = True
    if args.gdn_prefill_backend:
        config["engine_kwargs"]["gdn_prefill_backend"] = args.gdn_prefill_backend
    if args.conv_state_layout:
        config["runtime_env"]["env_vars"]["VLLM_SSM_CONV_STATE_LAYOUT"] = args.conv_state_layout
    if args.batching_interval_ms is not None:
        config["experimental_configs"] = {"stream_batching_interval_ms": args.batching_interval_ms}
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--served-name", default="qwen3-8b")
    parser.add_argument("--timeout-s", type=float, default=420.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--kv-bytes", type=int, default=32 * 2**30)
    parser.add_argument("--eager", action="store_true", help="enforce_eager, as the reference's article sets it")
    parser.add_argument("--language-model-only", action="store_true",
                        help="serve a multimodal checkpoint's text model only, as pdserve does (model_layout.py)")
    parser.add_argument("--gdn-prefill-backend", default="",
                        help="a hybrid's GDN prefill kernel; triton on Hopper, where vLLM 0.26's default is missing "
                             "(pdserve/engines/model_layout.py)")
    parser.add_argument("--conv-state-layout", default="",
                        help="VLLM_SSM_CONV_STATE_LAYOUT for the engines (DS: vLLM 0.26's NIXL transfer of a hybrid needs it)")
    parser.add_argument("--batching-interval-ms", type=int, default=None,
                        help="Ray Serve LLM's stream_batching_interval_ms (its default: 50)")
    args = parser.parse_args()
    config = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 8000}, "applications": [{
        "name": "reference", "import_path": "ray.serve.llm:build_pd_openai_app", "route_prefix": "/",
        "args": {role + "_config": engine(role, model_dir=args.model_dir, served_name=args.served_name, args=args)
                 for role in ("prefill", "decode")}}]}
    client = ServeSubmissionClient("http://127.0.0.1:8265")
    started_s = time.monotonic()
    client.deploy_applications(config)
    result: dict[str, Any] = {"config": config, "status": "TIMEOUT", "ready_s": None}
    while time.monotonic() - started_s < args.timeout_s:
        app = client.get_serve_details().get("applications", {}).get("reference", {})
        deployments = {name: (info.get("status"), info.get("message", "")[-400:])
                       for name, info in app.get("deployments", {}).items()}
        print(f"{time.monotonic() - started_s:5.0f}s {app.get('status')} "
              f"{ {name: status for name, (status, _) in deployments.items()} }", flush=True)
        result.update(status=app.get("status"), deployments=deployments)
        if app.get("status") in ("RUNNING", "DEPLOY_FAILED"):
            break
        time.sleep(POLL_S)
    if result["status"] == "RUNNING":
        result["ready_s"] = time.monotonic() - started_s
        result["answer"] = ask(args.served_name)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({key: result.get(key) for key in ("status", "ready_s", "answer")}, default=str))


def ask(served_name: str) -> str:
    body = json.dumps({"model": served_name, "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 16}).encode()
    request = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return f"{reply.status}: {reply.read()[:300]!r}"
    except OSError as exc:
        return f"no answer: {exc!r}"


if __name__ == "__main__":
    main()
