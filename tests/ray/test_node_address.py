"""Where replicas bind on their node: loopback while the whole cluster is this machine, the node's
address once it spans machines, and a node Ray registered on loopback keeps its own."""

from __future__ import annotations

import pytest

from pdserve.ray import node_address
from pdserve.ray.node_address import LOOPBACK_HOST, bind_host, spans_machines

# This machine as psutil.net_if_addrs lists it, and as Ray registers a node started on 127.0.0.1: under the
# address node_ip_address_from_perspective finds (ray/_private/services.py:786-800, resolve_ip_for_localhost).
HOST_ADDRESSES = {"127.0.0.1", "192.0.2.2", "::1", "fe80::1"}


def test_a_one_machine_cluster_registered_under_the_hosts_address_binds_loopback() -> None:
    assert bind_host("192.0.2.2", cluster_ips=["192.0.2.2"], local_ips=HOST_ADDRESSES) == LOOPBACK_HOST


def test_a_node_of_a_cluster_that_spans_machines_binds_its_own_address() -> None:
    assert bind_host("192.0.2.2", cluster_ips=["192.0.2.2", "192.0.2.7"], local_ips=HOST_ADDRESSES) == "192.0.2.2"
    assert bind_host("10.0.0.5", cluster_ips=["10.0.0.1", "10.0.0.5"], local_ips={"127.0.0.1", "10.0.0.5"}) == "10.0.0.5"


def test_a_node_ray_registered_on_a_loopback_address_keeps_it() -> None:
    """Ray keeps every loopback address but 127.0.0.1 as given: nodes on 127.0.0.2, .3, ... of one machine."""
    assert bind_host("127.0.0.3", cluster_ips=["127.0.0.2", "127.0.0.3"], local_ips=HOST_ADDRESSES) == "127.0.0.3"


def test_loopback_nodes_and_this_machines_addresses_are_one_machine() -> None:
    assert not spans_machines(["127.0.0.2", "127.0.0.5", "192.0.2.2"], local_ips=HOST_ADDRESSES)
    assert spans_machines(["192.0.2.2", "198.51.100.4"], local_ips=HOST_ADDRESSES)


async def test_a_replica_on_loopback_moves_once_a_node_of_another_machine_joins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = ["192.0.2.2"]

    async def cluster_node_ips() -> list[str]:
        return cluster

    monkeypatch.setattr(node_address, "node_ip", lambda: "192.0.2.2")
    monkeypatch.setattr(node_address, "cluster_node_ips", cluster_node_ips)
    monkeypatch.setattr(node_address, "local_addresses", lambda: HOST_ADDRESSES)
    assert await node_address.replica_bind_host() == LOOPBACK_HOST
    assert not await node_address.has_outgrown(LOOPBACK_HOST)
    cluster.append("198.51.100.4")
    assert await node_address.has_outgrown(LOOPBACK_HOST)
    assert not await node_address.has_outgrown("192.0.2.2")  # one that bound its node's address stays
