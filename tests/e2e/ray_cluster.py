"""A real multi-node Ray cluster on this machine: each node on its own loopback address, with
token authentication on (as Ray turns it on for any address but 127.0.0.1), and custom
resources that tell prefill, decode and head nodes apart."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import free_port_block

RAY = str(Path(sys.executable).with_name("ray"))
# Per node: node manager, object manager, metrics, dashboard agent (2), runtime env agent, 100 workers.
NODE_PORTS = 6 + 100


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

    def ray(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ray *args``; with ``check``, a failure raises with what Ray printed, which says why."""
        result = subprocess.run([RAY, *args], env=self.env, capture_output=True, text=True, check=False, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"ray {' '.join(args[:2])} exited {result.returncode}:\n"
                                 f"{(result.stdout + result.stderr)[-3000:]}")
        return result

    def running_replicas(self, app_name: str) -> dict[str, list[dict[str, Any]]]:
        """Ray's own view of an application: each deployment's running replicas (node_ip, pid, ...)."""
        script = ("import json, sys; from ray.dashboard.modules.serve.sdk import ServeSubmissionClient as C; "
                  "print(json.dumps(C(sys.argv[1]).get_serve_details()))")
        result = subprocess.run([sys.executable, "-c", script, self.dashboard_url], env=self.env,
                                capture_output=True, text=True, check=True, timeout=60)
        deployments = json.loads(result.stdout)["applications"][app_name]["deployments"]
        return {name: [replica for replica in deployment["replicas"] if replica["state"] == "RUNNING"]
                for name, deployment in deployments.items()}


@contextmanager
def local_cluster(head: Node, workers: list[Node], *, temp_dir: Path) -> Iterator[LocalCluster]:
    """Start ``head`` and ``workers`` with ``ray start``; ``ray stop`` them all on exit."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    head_ports = free_port_block(3)
    cluster = LocalCluster(head_ip=head.ip, gcs_port=head_ports, dashboard_url=f"http://{head.ip}:{head_ports + 1}",
                           env=env)
    try:
        cluster.ray("start", "--head", "--port", str(head_ports), "--dashboard-host", head.ip,
                    "--dashboard-port", str(head_ports + 1), "--ray-client-server-port", str(head_ports + 2),
                    "--temp-dir", str(temp_dir), *_node_args(head))
        for worker in workers:
            cluster.ray("start", "--address", f"{head.ip}:{head_ports}", *_node_args(worker))
        yield cluster
    finally:
        cluster.ray("stop", "--force", check=False)


def _node_args(node: Node) -> list[str]:
    base = free_port_block(NODE_PORTS)
    named = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
             "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")
    ports = [arg for offset, name in enumerate(named) for arg in (name, str(base + offset))]
    return [
        "--node-ip-address", node.ip, "--num-cpus", str(node.cpus), "--resources", json.dumps(node.resources),
        "--object-store-memory", str(200 * 2**20), "--disable-usage-stats", *ports,
        "--min-worker-port", str(base + 6), "--max-worker-port", str(base + NODE_PORTS - 1),
    ]
