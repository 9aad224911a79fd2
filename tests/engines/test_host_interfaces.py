"""pdserve/engines/host_interfaces.py: this host's addresses as its kernel lists them."""

from __future__ import annotations

import socket
from pathlib import Path

from pdserve.engines.host_interfaces import host_addresses

# /proc/net/if_inet6 as Linux writes it (net/ipv6/addrconf.c, if6_seq_show): address, index, prefix, scope, flags, name
IF_INET6 = ("00000000000000000000000000000001 01 80 10 80       lo\n"
            "fd000000000000000000000000000002 02 40 00 80     eth0\n")


def test_every_ipv4_address_is_found_with_its_interface() -> None:
    addresses = host_addresses(Path("/nonexistent"))
    assert ("127.0.0.1", "lo") in addresses
    assert {name for _address, name in addresses} <= {name for _index, name in socket.if_nameindex()}
    assert all(socket.inet_aton(address) for address, _name in addresses)


def test_ipv6_addresses_come_from_proc_net_if_inet6(tmp_path: Path) -> None:
    (tmp_path / "if_inet6").write_text(IF_INET6)
    assert host_addresses(tmp_path / "if_inet6")[-2:] == (("::1", "lo"), ("fd00::2", "eth0"))
