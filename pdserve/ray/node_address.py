"""The address a replica binds on its Ray node: the node's own, or loopback while the whole cluster
is this one machine. Ray registers a node started with ``--node-ip-address 127.0.0.1`` (or with none)
under the host's interface address (ray/scripts/scripts.py:855 calls services.resolve_ip_for_localhost,
which swaps 127.0.0.1, localhost and ::1 for node_ip_address_from_perspective), so the node's address
alone would open a laptop's engines to its network."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Collection, Iterable

import psutil
import ray
from ray.exceptions import RayError

from pdserve.gateway.exposure import is_loopback

log = logging.getLogger(__name__)
LOOPBACK_HOST = "127.0.0.1"


def bind_host(node_ip: str, *, cluster_ips: Iterable[str], local_ips: Collection[str]) -> str:
    """Pure. ``node_ip`` where it is loopback already (Ray keeps 127.0.0.2 and the like as given) or a
    node of the cluster (``cluster_ips``) is on another machine than this one (``local_ips``: the
    addresses of this machine's interfaces); else loopback."""
    if is_loopback(node_ip) or spans_machines(cluster_ips, local_ips=local_ips):
        return node_ip
    return LOOPBACK_HOST


def spans_machines(cluster_ips: Iterable[str], *, local_ips: Collection[str]) -> bool:
    """Whether some node is on another machine: its address is neither loopback nor one of this machine's."""
    return any(not is_loopback(ip) and ip not in local_ips for ip in cluster_ips)


async def replica_bind_host() -> str:
    """Where a replica on this node binds, from Ray's view of the cluster now."""
    return bind_host(node_ip(), cluster_ips=await cluster_node_ips(), local_ips=local_addresses())


async def has_outgrown(bound_host: str) -> bool:
    """Whether a replica that bound loopback on a one-machine cluster must move to its node's address:
    a node of another machine has joined, whose replicas could not reach it. False while Ray cannot say."""
    if bound_host == node_ip():
        return False
    try:
        cluster_ips = await cluster_node_ips()
    except RayError as exc:
        log.warning("could not list the cluster's nodes: %r", exc)
        return False
    return spans_machines(cluster_ips, local_ips=local_addresses())


def node_ip() -> str:
    """This node's address as Ray registered it."""
    address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return address


async def cluster_node_ips() -> list[str]:
    """The addresses of the cluster's live nodes, as Ray registered them (one call to Ray's GCS)."""
    nodes = await asyncio.to_thread(ray.nodes)
    return [str(node["NodeManagerAddress"]) for node in nodes if node["Alive"]]


def local_addresses() -> set[str]:
    """Every IPv4 and IPv6 address of this machine's (this network namespace's) interfaces."""
    return {address.address.split("%")[0] for addresses in psutil.net_if_addrs().values() for address in addresses
            if address.family in (socket.AF_INET, socket.AF_INET6)}
