"""A PD deployment on the bed of hosts (tests/netbed.py): the gateway, one prefill engine and one
decode engine, each in a namespace of its own and configured as a user configures separate machines
(its own engines bound to its address, the others by address). Used by tests/e2e/test_netbed.py and
bench/netbed_links.py. Engines run from the configured model (``PDSERVE_MODEL__PATH`` picks another).
"""

from __future__ import annotations

import contextlib
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

import httpx
import yaml

from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve_vllm import ENGINE_KEY_ENV
from tests.netbed import NetBed

ENGINE_PORT = {"prefill": 8100, "decode": 8200}
GATEWAY_PORT = 8000
READY_TIMEOUT_S = 900.0
# Network namespaces share this machine's system id and IPC namespace, so UCX would take them for one
# host and move KV through shared memory, never the veth (UCX src/uct/sm/base/sm_iface.c: its shared-
# memory transports reach an address of the same system id and IPC namespace). On separate machines
# without RDMA it takes tcp: the bed says so.
ACROSS_HOSTS_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
# The deployment's engine key, given to every host as a user gives PDSERVE_ENGINE_KEY to separate machines.
ENGINE_KEY = secrets.token_urlsafe(32)
ENGINE_HEADERS = {"Authorization": f"Bearer {ENGINE_KEY}"}
HOST_ENV = {**ACROSS_HOSTS_ENV, ENGINE_KEY_ENV: ENGINE_KEY}
KV_PULL_TIMEOUT_S = 10.0  # what a request across a cut link waits before its decode engine prefills it
EJECT_FOR_S = 20.0  # long enough that the request after a cut one still finds its prefill engine out
LINK_TIMEOUT_S = 10.0  # a connection to an engine whose host went silent fails after this (pd/engine_socket.py)
PROMPT = "The module provides functions for reading and writing files, sockets and other streams. " * 3


@dataclass
class Deployment:
    bed: NetBed
    gateway_url: str
    processes: dict[str, subprocess.Popen[str]]
    logs: dict[str, Path]

    def url(self, role: str) -> str:
        return f"http://{self.bed.hosts[role].address}:{ENGINE_PORT[role]}"

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def start(self, name: str) -> None:
        """Start host ``name``'s process (the gateway, or its engines) from its config, in its namespace."""
        config = self.logs[name].with_name(f"{name}.yaml")
        command = ([sys.executable, "-m", "pdserve", "serve", "--config", str(config)] if name == "gateway"
                   else [sys.executable, "-m", "tests.netbed_engines", str(config)])
        self.processes[name] = subprocess.Popen(self.bed.hosts[name].argv(*command), stdout=self.logs[name].open("a"),
                                                stderr=subprocess.STDOUT, text=True, cwd=Path.cwd(),
                                                env={**os.environ, **HOST_ENV})

    def until_ready(self) -> None:
        """Wait for the gateway's /health/ready: its engines answer and its warm-ups (sent again after a role had
        no healthy engine) are done, so no request of the gateway's own is still in flight."""
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline_s:
            for name, process in self.processes.items():
                assert process.poll() is None, f"{name} exited:\n{self.log(name)[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.gateway_url + "/health/ready", timeout=5).status_code == 200:
                    return
            time.sleep(2)
        raise AssertionError("the bed never became ready:\n" + "\n".join(
            f"--- {name}\n{self.log(name)[-2000:]}" for name in self.processes))

    def restart_engines(self, name: str) -> None:
        """Stop host ``name``'s engines and start them again at the same addresses; returns once they
        answer /health (the gateway may not have seen them yet)."""
        process = self.processes[name]
        process.terminate()
        process.wait(timeout=120)
        self.start(name)
        deadline_s = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline_s:
            assert self.processes[name].poll() is None, f"{name} exited:\n{self.log(name)[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url(name) + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(1)
        raise AssertionError(f"{name} did not come back:\n{self.log(name)[-3000:]}")


def host_config(bed: NetBed, name: str, *, workdir: Path) -> dict[str, Any]:
    """What a user writes on each machine: its own engines bound to its address, the others by address."""
    def urls(role: str) -> list[str]:
        return [f"http://{bed.hosts[role].address}:{ENGINE_PORT[role]}"]

    config: dict[str, Any] = {
        "prefill": {"engines": 1 if name == "prefill" else 0, "base_port": ENGINE_PORT["prefill"]},
        "decode": {"engines": 1 if name == "decode" else 0, "base_port": ENGINE_PORT["decode"]},
        "launch": {"engine_host": bed.hosts[name].address, "ready_timeout_s": READY_TIMEOUT_S,
                   "log_dir": str(workdir / f"{name}-logs")},
        # One gateway process: each of several keeps its own circuit breaker, so an ejection one made is
        # not the others' (docs/reliability.md lists that as open).
        "gateway": {"host": bed.hosts[name].address, "port": GATEWAY_PORT, "workers": 1, "eject_after_failures": 1,
                    "eject_for_s": EJECT_FOR_S, "kv_pull_timeout_s": KV_PULL_TIMEOUT_S, "link_timeout_s": LINK_TIMEOUT_S},
        "access": {"open": True},  # the bed's addresses are not loopback, and its tests send no key
    }
    for role in ("prefill", "decode"):
        if role != name:
            config[role]["urls"] = urls(role)
    return config


def complete(deployed: Deployment, *, mode: str, request_id: str) -> dict[str, Any]:
    body = {"model": DEMO_MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    reply = httpx.post(deployed.gateway_url + "/v1/completions", json=body, timeout=300,
                       headers={"X-PD-Mode": mode, "X-Request-Id": request_id})
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def stream(deployed: Deployment, *, request_id: str) -> bytes:
    """A streamed PD request (with usage, which proves the KV crossed: pd/kv_proof.py); its whole reply."""
    body = {"model": DEMO_MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    reply = httpx.post(deployed.gateway_url + "/v1/completions", json=body, timeout=300,
                       headers={"X-PD-Mode": "pd", "X-Request-Id": request_id})
    assert reply.status_code == 200, reply.text
    return reply.content


def recent(deployed: Deployment, request_id: str) -> dict[str, Any]:
    """The live page's record of ``request_id``. Each gateway worker lists its own requests, and each
    new connection may land on either: ask until the one that served it answers."""
    for _ in range(50):
        requests = httpx.get(deployed.gateway_url + "/dashboard/state", timeout=30).json()["requests"]
        found = [request for request in requests if request["request_id"] == request_id]
        if found:
            record: dict[str, Any] = found[0]
            return record
    raise AssertionError(f"no gateway worker lists {request_id}")


@contextmanager
def deployed(workdir: Path, *, tag: str = "pd") -> Iterator[Deployment]:
    """The bed and the deployment on it, ready (the gateway's /health/ready), for the block; all
    processes stopped and the bed removed after it."""
    with NetBed(["prefill", "decode", "gateway"], tag=tag, with_client=True) as bed:
        processes: dict[str, subprocess.Popen[str]] = {}
        deployment = Deployment(bed, f"http://{bed.hosts['gateway'].address}:{GATEWAY_PORT}", processes,
                                {name: workdir / f"{name}.log" for name in bed.hosts})
        try:
            for name in bed.hosts:
                (workdir / f"{name}.yaml").write_text(yaml.safe_dump(host_config(bed, name, workdir=workdir)))
                deployment.logs[name].write_text("")
                deployment.start(name)
            deployment.until_ready()
            yield deployment
        finally:
            for process in processes.values():
                process.terminate()
            for process in processes.values():
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
