"""A bed of hosts for tests: one network namespace per host, each joined to a switch by a veth
pair, so bytes between them cross real interfaces with their own addresses, queues and links.

The switch is a bridge in a namespace of its own, so nothing is left in this machine's own
network stack. No host has a default route: a partition is a partition, not a detour through the
sandbox's own route. Made by ``ip`` and ``tc`` (iproute2) as root; ``why_not`` says why not where
that cannot be done, for a skip that names the reason. Link faults:
- ``rate_limit``: a ``tbf`` qdisc on both ends of a host's link (each end shapes what it sends);
- ``link_down``/``link_up``: the host's port on the switch (cut from every other host);
- ``cut``/``mend``: two hosts no longer reach each other (an ``unreachable`` route on each side),
  while both still reach the rest;
- ``add_netem``: latency or loss, where the kernel has the netem qdisc (``netem_missing`` says).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Self

SUBNET = "10.77.0"  # hosts are SUBNET.2, .3, ...; /24 on the bridge
CLIENT_ADDRESS = f"{SUBNET}.1"  # this machine's own port on the switch, where the test's client runs
HOST_INTERFACE = "eth0"  # each host's end of its link, as a machine's NIC would be named
_BRIDGE = "br0"


@dataclass(frozen=True, slots=True)
class Host:
    name: str  # a role in the bed: "gateway", "prefill", "decode"
    namespace: str
    address: str
    switch_port: str  # the other end of its link, on the bridge

    def argv(self, *command: str) -> list[str]:
        """``command`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *command]


def why_not() -> str | None:
    """Why a bed cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"no {' or '.join(missing)} here: install iproute2 (`make netbed`)"
    probe = f"pdnb-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


class NetBed:
    """Hosts by name, made on ``__enter__`` and removed on ``__exit__`` (also after a failure)."""

    def __init__(self, names: Sequence[str], *, tag: str | None = None, with_client: bool = False) -> None:
        """``with_client``: this machine's own network stack gets a port too (CLIENT_ADDRESS), so the
        test itself reaches the hosts; removed with the switch."""
        self._tag = tag or str(os.getpid())
        self._client_port = f"pdnbc-{self._tag}"[:15] if with_client else None
        self._switch = f"pdnb-{self._tag}-sw"
        self.hosts = {name: Host(name=name, namespace=f"pdnb-{self._tag}-{name}", address=f"{SUBNET}.{index + 2}",
                                 switch_port=f"pdnb{index}-{self._tag}"[:15])
                      for index, name in enumerate(names)}

    def __enter__(self) -> Self:
        try:
            self._make()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self._remove()

    def _make(self) -> None:
        _ip("netns", "add", self._switch)
        _ip("-n", self._switch, "link", "add", _BRIDGE, "type", "bridge")
        _ip("-n", self._switch, "link", "set", _BRIDGE, "up")
        for host in self.hosts.values():
            _ip("netns", "add", host.namespace)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("link", "add", host.switch_port, "netns", self._switch, "type", "veth",
                "peer", "name", HOST_INTERFACE, "netns", host.namespace)
            _ip("-n", self._switch, "link", "set", host.switch_port, "master", _BRIDGE, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", HOST_INTERFACE)
            _ip("-n", host.namespace, "link", "set", HOST_INTERFACE, "up")
        if self._client_port is not None:
            switch_end = f"{self._client_port}s"[:15]
            _ip("link", "add", self._client_port, "type", "veth", "peer", "name", switch_end, "netns", self._switch)
            _ip("-n", self._switch, "link", "set", switch_end, "master", _BRIDGE, "up")
            _ip("addr", "add", f"{CLIENT_ADDRESS}/24", "dev", self._client_port)
            _ip("link", "set", self._client_port, "up")

    def _remove(self) -> None:
        for namespace in [host.namespace for host in self.hosts.values()] + [self._switch]:
            subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)  # its veth ends go with it
        if self._client_port is not None:  # gone with its peer in the switch, unless the switch never was
            subprocess.run(["ip", "link", "del", self._client_port], check=False, capture_output=True)

    def rate_limit(self, name: str, *, rate_mbit: int) -> None:
        """Both directions of ``name``'s link at ``rate_mbit``: the host shapes what it sends, its
        switch port what it receives."""
        host = self.hosts[name]
        for namespace, device in ((host.namespace, HOST_INTERFACE), (self._switch, host.switch_port)):
            _tc(namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit",
                "burst", f"{max(32, rate_mbit // 8)}kb", "latency", "50ms")

    def clear_limits(self, name: str) -> None:
        host = self.hosts[name]
        for namespace, device in ((host.namespace, HOST_INTERFACE), (self._switch, host.switch_port)):
            subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False,
                           capture_output=True)

    def add_netem(self, name: str, *netem: str) -> None:
        """``netem`` arguments (``delay 10ms``, ``loss 1%``) on what ``name`` sends; raises
        subprocess.CalledProcessError where the kernel has no netem."""
        _tc(self.hosts[name].namespace, "qdisc", "replace", "dev", HOST_INTERFACE, "root", "netem", *netem)

    def link_down(self, name: str) -> None:
        _ip("-n", self._switch, "link", "set", self.hosts[name].switch_port, "down")

    def link_up(self, name: str) -> None:
        _ip("-n", self._switch, "link", "set", self.hosts[name].switch_port, "up")

    def cut(self, first: str, second: str) -> None:
        """``first`` and ``second`` no longer reach each other (each gets ICMP unreachable)."""
        for here, there in ((first, second), (second, first)):
            _ip("-n", self.hosts[here].namespace, "route", "add", "unreachable", f"{self.hosts[there].address}/32")

    def mend(self, first: str, second: str) -> None:
        for here, there in ((first, second), (second, first)):
            _ip("-n", self.hosts[here].namespace, "route", "del", "unreachable", f"{self.hosts[there].address}/32")

    @contextmanager
    def cut_between(self, first: str, second: str) -> Iterator[None]:
        self.cut(first, second)
        try:
            yield
        finally:
            self.mend(first, second)


def netem_missing() -> str | None:
    """Why ``tc qdisc add ... netem`` fails here (this kernel has no netem), or None where it works."""
    with NetBed(["probe"], tag=f"nm{os.getpid()}") as bed:
        try:
            bed.add_netem("probe", "delay", "1ms")
        except subprocess.CalledProcessError as exc:
            return f"`tc qdisc add ... netem` fails here: {exc.stderr.strip()}"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _tc(namespace: str, *args: str) -> None:
    subprocess.run(["tc", "-n", namespace, *args], check=True, capture_output=True, text=True)
