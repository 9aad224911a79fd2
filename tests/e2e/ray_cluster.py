"""A real multi-node Ray cluster on this machine: each node on its own loopback address, with
token authentication on (as Ray turns it on for any address but 127.0.0.1), and custom
resources that tell prefill, decode and head nodes apart."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
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
# Ray binds AF_UNIX sockets under its temp dir, the dashboard's modules' longest: <temp dir>/session_<date>_<time>_
# <pid>/sockets/dash_MetricsHead, 66 bytes past it. Each module's process refuses a path over 107 bytes
# (ray/dashboard/subprocesses/utils.py:55, ray/_private/utils.py:1757) after `ray start` has returned, and the
# dashboard then exits ("Module MetricsHead failed to start. Received EOF from pipe", ray/dashboard/head.py:486).
# That leaves 41 bytes, which a pytest folder may pass (/tmp/pytest-of-root/pytest-73/ray-laptop0/ray: 45):
# Ray gets a short link to it.
RAY_TEMP_PARENT = "/tmp"


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
    KubeRay pod's get its env), Ray's files under ``temp_dir``; ``ray stop`` them all on exit."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", **(node_env or {})}
    head_ports, head_node_ports = free_port_block(3), free_port_block(NODE_PORTS)
    cluster = LocalCluster(head_ip=head.ip, gcs_port=head_ports, dashboard_url=f"http://{head.ip}:{head_ports + 1}",
                           env=env, head_worker_ports=range(head_node_ports + 6, head_node_ports + NODE_PORTS))
    with _short_link(temp_dir) as ray_temp_dir:
        try:
            cluster.ray("start", "--head", "--port", str(head_ports), "--dashboard-host", head.ip,
                        "--dashboard-port", str(head_ports + 1), "--ray-client-server-port", str(head_ports + 2),
                        "--temp-dir", str(ray_temp_dir), *_node_args(head, base=head_node_ports))
            _until_answers(cluster.dashboard_url, ray_temp_dir / "session_latest" / "logs")
            for worker in workers:
                cluster.ray("start", "--address", f"{head.ip}:{head_ports}",
                            *_node_args(worker, base=free_port_block(NODE_PORTS)))
            yield cluster
        finally:
            cluster.ray("stop", "--force", check=False)


@contextmanager
def _short_link(directory: Path) -> Iterator[Path]:
    """``directory`` (made if missing) by a path short enough for Ray's temp dir: a symlink under
    RAY_TEMP_PARENT, removed on exit."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ray", dir=RAY_TEMP_PARENT) as parent:
        link = Path(parent, "t")
        link.symlink_to(directory, target_is_directory=True)
        yield link


def _until_answers(url: str, logs: Path) -> None:
    """Wait for any HTTP answer from ``url``: `ray start` returns before the dashboard listens. Past the
    deadline, fail with what the dashboard's processes in ``logs`` wrote to stderr (a module that died says why)."""
    deadline_s = time.monotonic() + DASHBOARD_START_S
    while True:
        try:
            httpx.get(url + "/api/version", timeout=10)
            return
        except httpx.TransportError as error:
            if time.monotonic() > deadline_s:
                errors = "".join(f"\n{path.name}: {path.read_text()[-2000:]}"
                                 for path in sorted(logs.glob("dashboard*.err")) if path.stat().st_size)
                raise AssertionError(f"the Ray dashboard at {url} never answered{errors}") from error
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
