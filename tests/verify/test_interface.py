from __future__ import annotations

from pathlib import Path

from pdserve.pd.transfer_stats import TransferCounters
from pdserve.verify.checks import Link, judge
from pdserve.verify.interface import Interface, device_of_route, interface_to
from tests.verify.test_checks import probe


def test_the_route_names_the_device() -> None:
    assert device_of_route("10.77.0.3 dev eth0 src 10.77.0.2 uid 0 \\    cache ") == "eth0"
    assert device_of_route("local 127.0.0.1 dev lo src 127.0.0.1 uid 0 \\    cache <local> ") == "lo"
    assert device_of_route("") is None


def test_the_interface_to_an_address_has_the_kernels_speed_where_it_knows_it(tmp_path: Path) -> None:
    (tmp_path / "lo").mkdir()
    (tmp_path / "lo" / "speed").write_text("25000\n")
    assert interface_to("127.0.0.1", sys_net=tmp_path) == Interface("lo", 25000)
    (tmp_path / "lo" / "speed").write_text("-1\n")  # what a NIC without a link reports
    assert interface_to("127.0.0.1", sys_net=tmp_path) == Interface("lo", None)
    assert interface_to("127.0.0.1", sys_net=tmp_path / "none") == Interface("lo", None)  # loopback: EINVAL
    assert Interface("eth0", 10000).gbps == 1.25


def test_a_slow_network_verdict_names_the_interface_and_what_to_check() -> None:
    slow = judge(probe(TransferCounters(bytes=2e6, seconds=0.1, transfers=1, external_tokens=1000)),
                 link=Link.NETWORK, expected_gbps=1.25, min_fraction=0.5, via="eth0, 10000 Mb/s")
    assert not slow.is_ok
    assert "of the network link's 1.25 GB/s through eth0, 10000 Mb/s" in slow.problems[0]
    assert "check the link between the engines" in slow.problems[0]
