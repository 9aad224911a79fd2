"""Which network interface of this host carries traffic to an address, and its speed as the kernel
knows it: what ``pdserve verify`` measures a network pair's KV bandwidth against, instead of a
nominal 100 Gb/s. Reads ``ip route get`` and /sys/class/net; nothing else.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

_SYS_NET = Path("/sys/class/net")


@dataclass(frozen=True, slots=True)
class Interface:
    name: str
    speed_mbit: int | None  # /sys/class/net/NAME/speed; None where the kernel does not know (-1, or no file)

    @property
    def gbps(self) -> float | None:
        """Gigabytes (not bits) a second, as the verdicts count."""
        return None if self.speed_mbit is None else self.speed_mbit / 8000

    def describe(self) -> str:
        speed = "speed unknown" if self.speed_mbit is None else f"{self.speed_mbit} Mb/s"
        return f"{self.name}, {speed}"


def device_of_route(route: str) -> str | None:
    """The ``dev`` of one line of ``ip -o route get`` output; None if it names none, or the address
    is this host's own (a ``local`` route: loopback, whatever the address). Pure."""
    if route.startswith("local "):
        return None
    found = re.search(r"\bdev (\S+)", route)
    return found.group(1) if found else None


def link_interface(addresses: list[str], *, sys_net: Path = _SYS_NET) -> Interface | None:
    """The interface toward the first of ``addresses`` (a pair's engines, decode first) that is not
    this host: run on an engine's host, the one toward its peer. None if none has one."""
    return next((found for address in addresses if (found := interface_to(address, sys_net=sys_net))), None)


def interface_to(address: str, *, sys_net: Path = _SYS_NET) -> Interface | None:
    """The interface this host would send to ``address`` on; None where ``ip`` cannot say (no route,
    no iproute2, a host name it cannot resolve) or ``address`` is this host's own."""
    try:
        out = subprocess.run(["ip", "-o", "route", "get", address], check=False, capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = device_of_route(out.stdout) if out.returncode == 0 else None
    return None if name is None else Interface(name=name, speed_mbit=_speed_mbit(sys_net / name / "speed"))


def _speed_mbit(path: Path) -> int | None:
    try:
        speed = int(path.read_text().strip())
    except (OSError, ValueError):  # EINVAL for loopback and some virtual devices
        return None
    return speed if speed > 0 else None
