"""A real multi-node Ray cluster on this machine: each node on its own loopback address, with
token authentication on (as Ray turns it on for any address but 127.0.0.1), and custom
resources that tell prefill, decode and head nodes apart."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil

from tests.conftest import free_port_block

RAY = str(Path(sys.executable).with_name("ray"))
# Per node: node manager, object manager, metrics, dashboard agent (2), runtime env agent, 100 workers.
NODE_PORTS = 6 + 100
DASHBOARD_START_S = 120.0


@dataclass(frozen=True)
class Node:
    ip: str
    resources: dict[str, float]
    cpus: int


@dataclass(frozen=True)
class LocalCluster:
    head_ip: str
    gcs_port: int
    dashboard_url: str
    env: dict[str, str]  # what every client of this cluster needs: the token
    head_worker_ports: range  # where the head's Ray workers (Serve replicas included) take their own port

    def ray(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ray *args``; with ``check``, a failure raises with what Ray printed, which says why."""
        result = subprocess.run([RAY, *args], env=self.env, capture_output=True, text=True, check=False, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"ray {' '.join(args[:2])} exited {result.returncode}:\n"
                                 f"{(result.stdout + result.stderr)[-3000:]}")
        return result

    def pdserve(self, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """``pdserve *args`` as a user of this cluster runs it (its token in the environment)."""
        return subprocess.run([sys.executable, "-m", "pdserve", *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)

    def serve_details(self) -> dict[str, Any]:
        """What the Ray dashboard shows of Serve: every application's config, status and replicas."""
        script = ("import json, sys; from ray.dashboard.modules.serve.sdk import ServeSubmissionClient as C; "
                  "print(json.dumps(C(sys.argv[1]).get_serve_details()))")
        result = subprocess.run([sys.executable, "-c", script, self.dashboard_url], env=self.env,
                                capture_output=True, text=True, check=True, timeout=60)
        details: dict[str, Any] = json.loads(result.stdout)
        return details

    def running_replicas(self, app_name: str) -> dict[str, list[dict[str, Any]]]:
        """Ray's own view of an application: each deployment's running replicas (node_ip, pid, ...)."""
        deployments = self.serve_details()["applications"][app_name]["deployments"]
        return {name: [replica for replica in deployment["replicas"] if replica["state"] == "RUNNING"]
                for name, deployment in deployments.items()}


@contextmanager
def local_cluster(head: Node, workers: list[Node], *, temp_dir: Path,
                  node_env: dict[str, str] | None = None) -> Iterator[LocalCluster]:
    """Start ``head`` and ``workers`` with ``ray start`` (each node's processes get ``node_env`` too, as a
    KubeRay pod's get its env); ``ray stop`` them all on exit."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", **(node_env or {})}
    head_ports, head_node_ports = free_port_block(3), free_port_block(NODE_PORTS)
    cluster = LocalCluster(head_ip=head.ip, gcs_port=head_ports, dashboard_url=f"http://{head.ip}:{head_ports + 1}",
                           env=env, head_worker_ports=range(head_node_ports + 6, head_node_ports + NODE_PORTS))
    head_args = ["start", "--head", "--port", str(head_ports), "--dashboard-host", head.ip,
                 "--dashboard-port", str(head_ports + 1), "--ray-client-server-port", str(head_ports + 2),
                 "--temp-dir", str(temp_dir), *_node_args(head, base=head_node_ports)]
    try:
        cluster.ray(*head_args)
        try:
            _until_answers(cluster.dashboard_url)
        except httpx.TransportError:
            # Seen once under a CPU hog (CI of 7652940): the dashboard's MetricsHead module died at start ("Received
            # EOF from pipe") and the dashboard never listened; Ray itself was up. One fresh start of the head.
            cluster.ray("stop", "--force", check=False)
            cluster.ray(*head_args)
            _until_answers(cluster.dashboard_url)
        for worker in workers:
            cluster.ray("start", "--address", f"{head.ip}:{head_ports}",
                        *_node_args(worker, base=free_port_block(NODE_PORTS)))
        yield cluster
    finally:
        cluster.ray("stop", "--force", check=False)


def _until_answers(url: str) -> None:
    """Wait for any HTTP answer from ``url``: `ray start` returns before the dashboard listens."""
    deadline_s = time.monotonic() + DASHBOARD_START_S
    while True:
        try:
            httpx.get(url + "/api/version", timeout=10)
            return
        except httpx.TransportError:
            if time.monotonic() > deadline_s:
                raise
        time.sleep(1)


def _node_args(node: Node, *, base: int) -> list[str]:
    """``ray start``'s arguments for ``node``, its ports from ``base`` on (NODE_PORTS of them)."""
    named = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
             "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")
    ports = [arg for offset, name in enumerate(named) for arg in (name, str(base + offset))]
    return [
        "--node-ip-address", node.ip, "--num-cpus", str(node.cpus), "--resources", json.dumps(node.resources),
        "--object-store-memory", str(200 * 2**20), "--disable-usage-stats", *ports,
        "--min-worker-port", str(base + 6), "--max-worker-port", str(base + NODE_PORTS - 1),
    ]


def listener_pid(url: str) -> int:
    """The process listening on ``url``'s address and port."""
    parts = urlsplit(url)
    for connection in psutil.net_connections("tcp"):
        if (connection.status == psutil.CONN_LISTEN and connection.laddr.ip == parts.hostname
                and connection.laddr.port == parts.port and connection.pid):
            pid: int = connection.pid
            return pid
    raise AssertionError(f"nothing listens on {parts.hostname}:{parts.port}")
