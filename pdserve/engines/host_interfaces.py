"""This host's IP addresses and the network interface each is on, read from the kernel (IPv4 through the
SIOCGIFCONF ioctl, IPv6 from /proc/net/if_inet6), with no tool such as iproute2 that an engine image may lack.
Reads only; kv_link.py decides what follows from them."""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

SIOCGIFCONF = 0x8912  # linux/sockios.h
IFREQ_BYTES = 40  # struct ifreq on 64-bit Linux: a 16-byte name, then a 24-byte union (here a sockaddr_in)
IFNAMSIZ = 16
MAX_IPV4_ADDRESSES = 1024
IF_INET6 = Path("/proc/net/if_inet6")


def host_addresses(if_inet6: Path = IF_INET6) -> tuple[tuple[str, str], ...]:
    """(address, interface) for every address of this host's interfaces in this network namespace, up or not."""
    return _ipv4_addresses() + _ipv6_addresses(if_inet6)


def _ipv4_addresses() -> tuple[tuple[str, str], ...]:
    """SIOCGIFCONF lists every IPv4 address with its label (``eth0``, or ``eth0:1`` for a labelled alias)."""
    buffer = array.array("B", bytes(IFREQ_BYTES * MAX_IPV4_ADDRESSES))
    pointer, _ = buffer.buffer_info()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("iL", len(buffer), pointer)  # struct ifconf: length, then the buffer's address
        used_bytes, _ = struct.unpack("iL", fcntl.ioctl(probe.fileno(), SIOCGIFCONF, request))
    raw = buffer.tobytes()[:used_bytes]
    found = []
    for offset in range(0, used_bytes, IFREQ_BYTES):
        label = raw[offset:offset + IFNAMSIZ].split(b"\0", 1)[0].decode()
        address = socket.inet_ntoa(raw[offset + IFNAMSIZ + 4:offset + IFNAMSIZ + 8])  # sin_family, sin_port, sin_addr
        found.append((address, label.partition(":")[0]))
    return tuple(found)


def _ipv6_addresses(if_inet6: Path) -> tuple[tuple[str, str], ...]:
    """/proc/net/if_inet6: one line per address, 32 hex digits first and the interface last (no file: no IPv6)."""
    try:
        lines = if_inet6.read_text().splitlines()
    except OSError:
        return ()
    return tuple((str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))), fields[-1])
                 for line in lines if len(fields := line.split()) >= 6)
