"""Engines reachable only by pdserve, tried as an attacker on the cluster network would: the gateway, the prefill
engine and the decode engine each in a network namespace of its own (tests/netbed.py), and an attacker's host beside
them, neither gateway nor engine, running tests/netbed_attacker.py.

The attacker can do a real anonymous read: with a handshake it decodes vLLM's NixlHandshakePayload, adds the engine's
NIXL agent and READs registered KV blocks over TCP. Against 43e7218's engines (``PDSERVE_NETBED_ENGINES_TREE`` names
a checkout the engine hosts run from) it does; here it must get nothing. The bed's engines get no UCX_NET_DEVICES of
the bed's own (netbed_pd.ACROSS_HOSTS_ENV), so the interface their transport listens on is the one pdserve chose,
and each engine host has a second interface, as a node on two networks has, where nothing may listen.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.config import parse_settings
from tests import netbed
from tests.netbed import Host, NetBed
from tests.netbed_pd import GATEWAY_PORT, HOST_ENV, Deployment, host_config, recent, stream

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif((reason := netbed.why_not()) is not None, reason=f"NO NETWORK BED: {reason}")]

ENGINES = ("prefill", "decode")
# The checkout the engine hosts run pdserve (and pdserve_vllm) from; this one unless set.
ENGINES_TREE = Path(os.environ.get("PDSERVE_NETBED_ENGINES_TREE", Path.cwd()))
ENGINE_ENV = {name: value for name, value in HOST_ENV.items() if name != "UCX_NET_DEVICES"}
ATTACK_TIMEOUT_S = 300
SECOND_NIC = "nic1"
SECOND_NIC_ADDRESS = {"prefill": "10.88.2.1", "decode": "10.88.3.1"}  # a subnet each: no route between them


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    workdir = tmp_path_factory.mktemp("netbed-security")
    with NetBed([*ENGINES, "gateway", "attacker"], tag="sec", with_client=True) as bed:
        made = Deployment(bed, f"http://{bed.hosts['gateway'].address}:{GATEWAY_PORT}", {},
                          {name: workdir / f"{name}.log" for name in ("gateway", *ENGINES)})
        try:
            for name in made.logs:
                config = host_config(bed, name, workdir=workdir)
                if name in ENGINES:
                    config.pop("access", None)  # the gateway's; an engine host reads none of it (43e7218 knew none)
                    add_second_nic(bed.hosts[name], SECOND_NIC_ADDRESS[name])
                (workdir / f"{name}.yaml").write_text(yaml.safe_dump(config))
                made.logs[name].write_text("")
                start(made, name)
            made.until_ready()
            yield made
        finally:
            for process in made.processes.values():
                process.terminate()
            for process in made.processes.values():
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def add_second_nic(host: Host, address: str) -> None:
    """A second interface up in ``host``'s namespace (a veth pair whose both ends stay there), holding ``address``."""
    for args in (("link", "add", SECOND_NIC, "type", "veth", "peer", "name", f"{SECOND_NIC}p"),
                 ("addr", "add", f"{address}/24", "dev", SECOND_NIC),
                 ("link", "set", f"{SECOND_NIC}p", "up"), ("link", "set", SECOND_NIC, "up")):
        subprocess.run(["ip", "-n", host.namespace, *args], check=True, capture_output=True, text=True)


def start(deployment: Deployment, name: str) -> None:
    """The gateway as the bed starts it; an engine host from ENGINES_TREE, with the bed's env less its UCX devices."""
    if name == "gateway":
        deployment.start(name)
        return
    config = deployment.logs[name].with_name(f"{name}.yaml")
    argv = deployment.bed.hosts[name].argv(sys.executable, "-m", "tests.netbed_engines", str(config))
    deployment.processes[name] = subprocess.Popen(argv, stdout=deployment.logs[name].open("a"),
                                                  stderr=subprocess.STDOUT, text=True, cwd=ENGINES_TREE,
                                                  env={**os.environ, **ENGINE_ENV})


def attack(deployment: Deployment, *args: str) -> dict[str, Any]:
    """tests/netbed_attacker.py run on the attacker's host (from this checkout), holding the engine key only where
    a command acts as a keyed peer; its JSON."""
    out = subprocess.run(deployment.bed.hosts["attacker"].argv(sys.executable, "-m", "tests.netbed_attacker", *args),
                         env={**os.environ, **ENGINE_ENV}, cwd=Path.cwd(), capture_output=True, text=True,
                         timeout=ATTACK_TIMEOUT_S, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    found: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return found


def side_channel(deployment: Deployment, role: str) -> tuple[str, str]:
    """(address, port) of ``role``'s NIXL side channel, from its host's config as pdserve reads it."""
    config = yaml.safe_load(deployment.logs[role].with_name(f"{role}.yaml").read_text())
    spec = parse_settings(config, source="bed").engine_specs()[0]
    return deployment.bed.hosts[role].address, str(spec.side_channel_port)


@pytest.mark.parametrize("role", ENGINES)
def test_an_engines_http_port_refuses_every_route_without_the_key(deployment: Deployment, role: str) -> None:
    found = attack(deployment, "http", deployment.url(role))
    assert found["health"] == 200  # probes
    assert set(found["routes"].values()) == {401}, found  # /v1 and not: /invocations, /tokenize, /metrics, ...


@pytest.mark.parametrize("role", ENGINES)
def test_a_nixl_handshake_without_the_key_gets_nothing_to_read_kv_with(deployment: Deployment, role: str) -> None:
    found = attack(deployment, "read", *side_channel(deployment, role))
    assert found["handshake"] != "succeeded" and not found["payload"] and "read_bytes" not in found, (
        f"an anonymous peer read {role}'s KV: {found}")


@pytest.mark.parametrize("role", ENGINES)
def test_an_engine_listens_on_its_own_address_alone(deployment: Deployment, role: str) -> None:
    """Every TCP and UDP socket listening in the engine host's namespace (its supervisor and engine processes only):
    vLLM's HTTP port and side channel and NIXL's UCX transport on the engine's address; on loopback, which only the
    host itself reaches, torch.distributed's gloo pairs of vLLM's engine core; nothing on the second interface or
    on a wildcard."""
    host = deployment.bed.hosts[role]
    out = subprocess.run(host.argv("ss", "-H", "-l", "-t", "-u", "-n", "-p"), capture_output=True, text=True,
                         check=True)
    listeners = [(fields[4].rpartition(":")[0].strip("[]"), fields[-1]) for line in out.stdout.splitlines()
                 if len(fields := line.split()) >= 6]
    assert sum(address == host.address and "VLLM::EngineCor" in process for address, process in listeners) >= 2, (
        listeners)  # the side channel and NIXL's transport, at least
    strays = [(address, process) for address, process in listeners
              if address != host.address and not is_loopback(address)]
    assert not strays, f"{role} listens beyond {host.address} and loopback: {strays}"


def is_loopback(address: str) -> bool:
    """``ss``'s local address (``*`` or ``[::]`` for a wildcard) is a loopback address."""
    try:
        return ipaddress.ip_address(address.partition("%")[0]).is_loopback
    except ValueError:
        return False


def test_malformed_frames_leave_the_side_channel_answering_and_pd_working(deployment: Deployment) -> None:
    """Frames vLLM's listener cannot decode, from a peer with no key and from one with it; the side channel answers
    whom it answered before, and a PD request through the gateway still hands its KV over."""
    address = side_channel(deployment, "prefill")
    before = attack(deployment, "probe", *address)
    assert any(before.values()), before
    attack(deployment, "malformed", *address)
    assert attack(deployment, "probe", *address) == before
    stream(deployment, request_id="sec-after-malformed")
    assert recent(deployment, "sec-after-malformed")["kv"] == "pulled"
