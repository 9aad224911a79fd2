from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.pd.transfer_stats import TransferCounters
from pdserve.verify.checks import Link, judge
from pdserve.verify.interface import Interface, device_of_route, interface_to
from tests import netbed
from tests.netbed import NetBed
from tests.verify.test_checks import probe


def test_the_route_names_the_device() -> None:
    assert device_of_route("10.77.0.3 dev eth0 src 10.77.0.2 uid 0 \\    cache ") == "eth0"
    assert device_of_route("local 10.77.0.3 dev lo table local src 10.77.0.3 uid 0 \\    cache <local> ") is None
    assert device_of_route("") is None


@pytest.mark.skipif((reason := netbed.why_not()) is not None, reason=f"NO NETWORK BED: {reason}")
def test_the_interface_toward_the_peer_has_the_kernels_speed_where_it_knows_it() -> None:
    """Run on the decode engine's host, the link is the route toward the prefill engine's."""
    with NetBed(["prefill", "decode"], tag="vi") as bed:
        decode, prefill = bed.hosts["decode"], bed.hosts["prefill"]
        code = ("import sys; from pdserve.verify.interface import link_interface; "
                "print(link_interface(sys.argv[1:]).describe())")
        out = subprocess.run(decode.argv(sys.executable, "-c", code, decode.address, prefill.address),
                             check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "eth0, 10000 Mb/s"  # a veth's speed; never loopback's
    assert interface_to("127.0.0.1") is None  # this host's own: no link to judge
    assert Interface("eth0", 10000).gbps == 1.25


def test_a_slow_network_verdict_names_the_interface_and_what_to_check() -> None:
    slow = judge(probe(TransferCounters(bytes=2e6, seconds=0.1, transfers=1, external_tokens=1000)),
                 link=Link.NETWORK, expected_gbps=1.25, min_fraction=0.5, via="eth0, 10000 Mb/s")
    assert not slow.is_ok
    assert "of the network link's 1.25 GB/s through eth0, 10000 Mb/s" in slow.problems[0]
    assert "check the link between the engines" in slow.problems[0]
