from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine_config import KVTransferSpec, PoolSpec
from pdserve.engines.kv_link import (
    BufferChoice,
    HostLink,
    choose_buffer_device,
    has_gpudirect,
    is_efa_asked,
    libfabric_env,
    libfabric_provider,
    probe_host_link,
    transport_env,
)
from pdserve.errors import ConfigError

GPU = PoolSpec(device="cuda", gpu_ids=[0])
EFA_GPU = PoolSpec.model_validate({"device": "cuda", "gpu_ids": [0], "placement": {"efa_devices": 1}})
LIBFABRIC = KVTransferSpec(backends=["LIBFABRIC"])
HOST = (("127.0.0.1", "lo"), ("10.0.0.5", "eth0"), ("::1", "lo"))


def fake_sys(root: Path, *, devices: dict[str, str], modules: tuple[str, ...] = ()) -> Path:
    """A /sys with RDMA devices (name -> driver) and loaded kernel modules."""
    for name, driver in devices.items():
        (root / "bus" / driver).mkdir(parents=True, exist_ok=True)
        (root / "class" / "infiniband" / name / "device").mkdir(parents=True)
        (root / "class" / "infiniband" / name / "device" / "driver").symlink_to(root / "bus" / driver)
        (root / "class" / "infiniband" / name / "ports" / "1").mkdir(parents=True)
    for module in modules:
        (root / "module" / module).mkdir(parents=True)
    return root


def test_probe_finds_efa_devices_peermem_and_ucx_cuda_transports(tmp_path: Path) -> None:
    root = fake_sys(tmp_path / "sys", devices={"rdmap16s27": "efa", "mlx5_0": "mlx5_core"},
                    modules=("nvidia_peermem",))
    ucx = tmp_path / "ucx"
    ucx.mkdir()
    assert probe_host_link(root, ucx_dirs=(ucx,), addresses=HOST) == HostLink(
        ("rdmap16s27",), has_peermem=True, ucx_has_cuda=False, addresses=HOST, rdma_ports=("mlx5_0:1", "rdmap16s27:1"))
    (ucx / "libuct_cuda.so.0").touch()
    bare = probe_host_link(fake_sys(tmp_path / "bare", devices={}), ucx_dirs=(ucx,), addresses=HOST)
    assert bare == HostLink((), has_peermem=False, ucx_has_cuda=True, addresses=HOST)


def test_probe_reads_this_hosts_own_addresses(tmp_path: Path) -> None:
    assert ("127.0.0.1", "lo") in probe_host_link(fake_sys(tmp_path, devices={}), ucx_dirs=()).addresses


def test_nixls_transports_listen_on_the_interface_of_the_engines_address_and_keep_rdma_ports() -> None:
    assert transport_env("127.0.0.1", kv=KVTransferSpec(), pool=PoolSpec(), link=HostLink(addresses=HOST)) == {
        "UCX_NET_DEVICES": "lo"}
    link = HostLink(addresses=HOST, rdma_ports=("mlx5_0:1",))
    assert transport_env("10.0.0.5", kv=KVTransferSpec(), pool=GPU, link=link) == {"UCX_NET_DEVICES": "eth0,mlx5_0:1"}
    assert transport_env("0:0::1", kv=KVTransferSpec(), pool=GPU, link=link)["UCX_NET_DEVICES"].startswith("lo,")


def test_libfabrics_tcp_provider_gets_the_interface_and_its_efa_provider_nothing_more() -> None:
    both = KVTransferSpec(backends=["UCX", "LIBFABRIC"])
    assert transport_env("10.0.0.5", kv=both, pool=GPU, link=HostLink(addresses=HOST)) == {
        "UCX_NET_DEVICES": "eth0", "FI_TCP_IFACE": "eth0"}
    efa = HostLink(("rdmap0",), addresses=HOST, rdma_ports=("rdmap0:1",))
    assert transport_env("10.0.0.5", kv=LIBFABRIC, pool=EFA_GPU, link=efa) == {"UCX_NET_DEVICES": "eth0,rdmap0:1"}


def test_every_loopback_address_is_on_the_loopback_interface() -> None:
    """Engines on 127.0.0.3 and 127.0.0.4 (Ray nodes registered there, tests/e2e/test_ray.py): lo lists only 127.0.0.1."""
    assert transport_env("127.0.0.3", kv=KVTransferSpec(), pool=PoolSpec(), link=HostLink(addresses=HOST)) == {
        "UCX_NET_DEVICES": "lo"}


@pytest.mark.parametrize("host", ["10.9.9.9", "engine.example"])
def test_an_engine_address_on_no_interface_of_this_host_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match=f"engine address '{host}' .* on no interface of this host"):
        transport_env(host, kv=KVTransferSpec(), pool=PoolSpec(), link=HostLink(addresses=HOST))


def test_the_eks_amis_efa_peermem_module_counts_as_gpudirect(tmp_path: Path) -> None:
    root = fake_sys(tmp_path / "sys", devices={"rdmap16s27": "efa"}, modules=("efa_nv_peermem",))
    assert probe_host_link(root, ucx_dirs=()).has_peermem


def test_gpudirect_is_the_p_series_from_p4d_on() -> None:
    assert all(has_gpudirect(kind) for kind in ("p4d.24xlarge", "p5.48xlarge", "p5en.48xlarge", "p6-b200.48xlarge"))
    assert not any(has_gpudirect(kind) for kind in ("g6.8xlarge", "g6e.12xlarge", "g5.48xlarge", "m7i.xlarge"))


@pytest.mark.parametrize(
    ("kv", "pool", "link", "expected"),
    [
        (KVTransferSpec(), PoolSpec(), HostLink(), BufferChoice("cpu", "CPU engine")),
        (KVTransferSpec(), GPU, HostLink(), BufferChoice("cuda", "NIXL's UCX has cuda transports (cuda_ipc on one host)")),
        (KVTransferSpec(), GPU, HostLink(ucx_has_cuda=False), BufferChoice("cpu", "NIXL's UCX has no cuda transports")),
        # an L4 node: EFA, but no GPUDirect RDMA
        (LIBFABRIC, EFA_GPU, HostLink(("rdmap0",)), BufferChoice("cpu", "EFA without GPUDirect RDMA (no peermem module loaded)")),
        (LIBFABRIC, EFA_GPU, HostLink(("rdmap0",), has_peermem=True),
         BufferChoice("cuda", "EFA with GPUDirect RDMA (a peermem module loaded)")),
        (LIBFABRIC, GPU, HostLink(has_peermem=True), BufferChoice("cpu", "libfabric's tcp provider cannot read GPU memory")),
        (KVTransferSpec(backends=["LIBFABRIC"], buffer_device="cuda"), GPU, HostLink(),
         BufferChoice("cuda", "set by kv.buffer_device")),
    ],
)
def test_kv_buffer_stays_in_gpu_memory_only_where_the_link_reads_it(
    kv: KVTransferSpec, pool: PoolSpec, link: HostLink, expected: BufferChoice
) -> None:
    assert choose_buffer_device(kv, pool, link) == expected


def test_libfabric_provider_is_efa_where_placed_or_present_else_tcp_unless_named() -> None:
    assert libfabric_provider(LIBFABRIC, EFA_GPU, HostLink()) == ("efa", "placement.efa_devices=1")
    assert libfabric_provider(LIBFABRIC, GPU, HostLink(("rdmap0",))) == ("efa", "EFA devices on this host: rdmap0")
    assert libfabric_provider(LIBFABRIC, PoolSpec(), HostLink()) == ("tcp", "no EFA device on this host")
    named = KVTransferSpec(backends=["LIBFABRIC"], libfabric_provider="shm")
    assert libfabric_provider(named, EFA_GPU, HostLink(("rdmap0",))) == ("shm", "set by kv.libfabric_provider")
    assert is_efa_asked(LIBFABRIC, (PoolSpec(), EFA_GPU)) and not is_efa_asked(LIBFABRIC, (PoolSpec(), GPU))
    assert is_efa_asked(KVTransferSpec(libfabric_provider="efa"), (GPU,))


def test_efa_engines_get_fork_safety_and_leave_device_rdma_to_libfabric() -> None:
    """FI_EFA_USE_DEVICE_RDMA=0 would make libfabric emulate every RDMA read, even from host memory."""
    # NIXL_LOG_LEVEL=INFO: NIXL prints the provider it opened (kv_path.OPENED_PROVIDER)
    assert libfabric_env("efa") == {"FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1", "NIXL_LOG_LEVEL": "INFO"}
    assert libfabric_env("tcp") == {"FI_PROVIDER": "tcp", "NIXL_LOG_LEVEL": "INFO"}
