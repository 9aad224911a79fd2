"""The bed of hosts itself (tests/netbed.py): bytes cross between namespaces at the link's rate,
and a link taken down or cut stops them. No engines: the bed's own contract, fast."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests import netbed
from tests.netbed import NetBed

pytestmark = pytest.mark.skipif((reason := netbed.why_not()) is not None, reason=f"NO NETWORK BED: {reason}")
PORT = 7700
# Sends SIZE bytes to whoever connects, once.
SERVER = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); "
          "s.bind((sys.argv[1],int(sys.argv[2]))); s.listen(); c,_=s.accept(); c.sendall(b'x'*int(sys.argv[3])); c.close()")
# A host answers a connection to a closed port with a reset; an unreachable one does not answer it at all.
REACH = ("import socket,sys\ntry: socket.create_connection((sys.argv[1], 9), timeout=1)\n"
         "except ConnectionRefusedError: print('yes')\nexcept OSError: print('no')")
CLIENT = ("import socket,sys,time; c=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=5); t=time.monotonic(); n=0\n"
          "while (d:=c.recv(1<<20)): n+=len(d)\n"
          "print(n, time.monotonic()-t)")


@pytest.fixture(scope="module")
def bed() -> Iterator[NetBed]:
    with NetBed(["prefill", "decode", "gateway"], tag="t") as made:
        yield made


def pull(bed: NetBed, *, size_bytes: int) -> tuple[int, float]:
    """``decode`` reads ``size_bytes`` from ``prefill`` over the bed: bytes read and seconds taken."""
    prefill, decode = bed.hosts["prefill"], bed.hosts["decode"]
    server = subprocess.Popen(prefill.argv(sys.executable, "-c", SERVER, prefill.address, str(PORT), str(size_bytes)))
    try:
        time.sleep(0.3)
        out = subprocess.run(decode.argv(sys.executable, "-c", CLIENT, prefill.address, str(PORT)),
                             check=False, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        count, seconds = out.stdout.split()
        return int(count), float(seconds)
    finally:
        server.kill()
        server.wait()


def reaches(bed: NetBed, here: str, there: str) -> bool:
    out = subprocess.run(bed.hosts[here].argv(sys.executable, "-c", REACH, bed.hosts[there].address),
                         check=False, capture_output=True, text=True, timeout=30)
    return out.stdout.strip() == "yes"


def test_bytes_cross_between_hosts_and_a_rate_limit_holds_them_to_the_link_rate(bed: NetBed) -> None:
    size = 25_000_000
    count, unlimited_s = pull(bed, size_bytes=size)
    assert count == size
    bed.rate_limit("prefill", rate_mbit=100)
    try:
        count, limited_s = pull(bed, size_bytes=size)
    finally:
        bed.clear_limits("prefill")
    assert count == size
    assert limited_s > 0.8 * size * 8 / 100e6 > unlimited_s  # 2 s at 100 Mbit/s; a veth is far faster


def test_a_cut_stops_two_hosts_and_spares_the_rest(bed: NetBed) -> None:
    with bed.cut_between("prefill", "decode"):
        assert not reaches(bed, "decode", "prefill") and not reaches(bed, "prefill", "decode")
        assert reaches(bed, "gateway", "prefill") and reaches(bed, "gateway", "decode")
    assert reaches(bed, "decode", "prefill")


def test_a_link_down_cuts_a_host_from_all_until_it_is_up(bed: NetBed) -> None:
    bed.link_down("prefill")
    try:
        assert not reaches(bed, "decode", "prefill") and not reaches(bed, "gateway", "prefill")
    finally:
        bed.link_up("prefill")
    assert any(reaches(bed, "decode", "prefill") for _ in range(10))  # the bridge port comes back through its states


def test_no_host_has_a_default_route(bed: NetBed) -> None:
    routes = subprocess.run(bed.hosts["decode"].argv("ip", "route"), check=False, capture_output=True,
                            text=True).stdout
    assert "default" not in routes and f"{netbed.SUBNET}.0/24" in routes


def test_latency_and_loss_need_netem() -> None:
    if (missing := netbed.netem_missing()) is not None:
        pytest.skip(f"NO NETEM: latency and loss cannot be emulated: {missing}")
    with NetBed(["prefill", "decode"], tag="n") as bed:
        bed.add_netem("prefill", "delay", "200ms")
        started_s = time.monotonic()
        assert reaches(bed, "decode", "prefill")
        assert time.monotonic() - started_s > 0.2  # the reset came back late
