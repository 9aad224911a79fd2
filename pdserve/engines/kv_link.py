"""What the KV link of this host can do, and the choices that follow: the libfabric provider, its
environment, whether the KV buffer can stay in GPU memory, and the interface NIXL's transports listen on.
``probe_host_link`` reads the host; everything else is pure.

A link that cannot read GPU memory (a tcp provider, a UCX without cuda transports), or may not (EFA
without a sign of peer-to-peer access to the GPU, such as g6's L4 nodes), stages KV through host memory:
vLLM's ``kv_buffer_device: cpu``. docs/transport.md ("GPU memory on g6") says why from libfabric's and
the EFA driver's sources.
"""

from __future__ import annotations

import importlib.util
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine_config import KVTransferSpec, PoolSpec
from pdserve.engines.host_interfaces import host_addresses
from pdserve.errors import ConfigError

SYS_ROOT = Path("/sys")
# Kernel modules that let an RDMA NIC read GPU memory without dma-buf: NVIDIA's, and the one the EKS
# AL2023 NVIDIA AMI ships for EFA (efa-nv-peermem; amazon-eks-ami templates/al2023/provisioners/install-efa.sh).
# Sufficient, not necessary: AWS's EFA driver also maps GPU pages through nvidia.ko's own p2p symbols
# (amzn-drivers kernel/linux/efa efa_nvmem_impl.h), and dma-buf needs no module.
PEERMEM_MODULES = ("nvidia_peermem", "efa_nv_peermem")
# EC2 families whose EFA reads GPU memory in place (GPUDirect RDMA): the P-series from p4d on. Elsewhere
# (g6, g6e, ...) the NIC reads GPU memory in place only if the device reports RDMA read (libfabric's CUDA
# p2p probe asks for remote read: prov/efa efa_hmem.c) and dma-buf or the EFA driver's p2p path is there;
# otherwise libfabric copies through its own host buffers (prov/efa rdm/efa_rdm_mr.c). Neither is known
# when rendering, and at 25 Gbit/s the host copy costs little, so those stage KV in host memory.
GPUDIRECT_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "p6")
NIXL_LOG_LEVEL_ENV = "NIXL_LOG_LEVEL"  # read once per process by NIXL (src/utils/common/nixl_log.cpp)
LOOPBACK_ADDRESSES = (("127.0.0.1", "lo"), ("::1", "lo"))


@dataclass(frozen=True, slots=True)
class HostLink:
    """This host's network devices and GPU-memory access, as seen from sysfs and NIXL's files."""

    efa_devices: tuple[str, ...] = ()  # /sys/class/infiniband devices bound to the efa driver
    has_peermem: bool = False  # a peermem module loaded (PEERMEM_MODULES): RDMA NICs can read GPU memory
    ucx_has_cuda: bool = True  # NIXL's UCX ships its cuda transports (libuct_cuda)
    addresses: tuple[tuple[str, str], ...] = LOOPBACK_ADDRESSES  # (IP address, interface) of this host
    rdma_ports: tuple[str, ...] = ()  # every /sys/class/infiniband device's ports, as UCX names them: mlx5_0:1

    def interface_of(self, address: str) -> str | None:
        """The interface holding ``address`` (an IP address; None for a name, or one not on this host)."""
        try:
            wanted = ipaddress.ip_address(address)
        except ValueError:
            return None
        held = [(ipaddress.ip_address(held), name) for held, name in self.addresses]
        if wanted.is_loopback:  # Linux routes all of 127.0.0.0/8 to lo, which lists 127.0.0.1 alone
            return next((name for address, name in held if address.is_loopback and address.version == wanted.version),
                        None)
        return next((name for address, name in held if address == wanted), None)


@dataclass(frozen=True, slots=True)
class BufferChoice:
    device: str  # vLLM's kv_buffer_device: "cpu" or "cuda"
    reason: str


def probe_host_link(sys_root: Path = SYS_ROOT, ucx_dirs: tuple[Path, ...] | None = None,
                    addresses: tuple[tuple[str, str], ...] | None = None) -> HostLink:
    """Read this host's EFA devices and RDMA ports, peermem modules, NIXL's UCX transports (files only, no CUDA)
    and, unless ``addresses`` are given, its interfaces' addresses (host_interfaces.py)."""
    devices = sys_root / "class" / "infiniband"
    rdma = sorted(devices.iterdir()) if devices.is_dir() else []
    efa = tuple(device.name for device in rdma if (device / "device" / "driver").resolve().name == "efa")
    ports = tuple(f"{device.name}:{port.name}" for device in rdma
                  for port in sorted((device / "ports").iterdir() if (device / "ports").is_dir() else ()))
    dirs = _nixl_ucx_dirs() if ucx_dirs is None else ucx_dirs
    has_peermem = any((sys_root / "module" / module).is_dir() for module in PEERMEM_MODULES)
    return HostLink(efa_devices=efa, has_peermem=has_peermem,
                    ucx_has_cuda=not dirs or any(any(d.glob("libuct_cuda*.so*")) for d in dirs),
                    addresses=host_addresses() if addresses is None else addresses, rdma_ports=ports)


def _nixl_ucx_dirs() -> tuple[Path, ...]:
    """Where NIXL's wheels keep their bundled UCX transports (empty when NIXL is not installed here)."""
    spec = importlib.util.find_spec("nixl")
    if spec is None or not spec.origin:
        return ()
    site = Path(spec.origin).parent.parent
    return tuple(path for path in site.glob("nixl_cu*.libs/ucx") if path.is_dir())


def is_efa_asked(kv: KVTransferSpec, pools: tuple[PoolSpec, ...]) -> bool:
    """Whether the deployment asked for EFA: EFA interfaces in a placement, or the provider by name."""
    return kv.libfabric_provider == "efa" or any(pool.placement.efa_devices > 0 for pool in pools)


def libfabric_provider(kv: KVTransferSpec, pool: PoolSpec, link: HostLink) -> tuple[str, str]:
    """(provider, why) for NIXL's LIBFABRIC backend: the configured one, else efa where EFA is asked
    for or present, else tcp (NIXL would otherwise take whichever libfabric lists first)."""
    if kv.libfabric_provider != "auto":
        return kv.libfabric_provider, "set by kv.libfabric_provider"
    if pool.placement.efa_devices > 0:
        return "efa", f"placement.efa_devices={pool.placement.efa_devices}"
    if link.efa_devices:
        return "efa", f"EFA devices on this host: {','.join(link.efa_devices)}"
    return "tcp", "no EFA device on this host"


def has_gpudirect(instance_type: str) -> bool:
    """Whether an EC2 instance type's EFA is relied on to read GPU memory in place (``p5.48xlarge`` yes,
    ``g6.8xlarge`` no: see GPUDIRECT_FAMILIES)."""
    family = instance_type.partition(".")[0]
    return family in GPUDIRECT_FAMILIES or family.startswith("p6")


def libfabric_env(provider: str) -> dict[str, str]:
    """Environment of an engine whose KV moves over NIXL's LIBFABRIC backend.

    FI_EFA_USE_DEVICE_RDMA stays unset: libfabric then uses the device's RDMA read wherever it has it
    (NIXL asks for API 1.18; prov/efa efa_rdm_get_use_device_rdma), where 0 would emulate every read.
    NIXL_LOG_LEVEL=INFO, the least verbose level that prints NIXL's "Created N rails using provider=X"
    (kv_path.OPENED_PROVIDER), so the provider reported is the one libfabric opened; NIXL's default, WARN,
    prints none of it. INFO adds a few lines per engine start and per peer connection, none per transfer
    (vLLM posts prepared transfers, whose path logs nothing at INFO: nixl src/core/nixl_agent.cpp)."""
    env = {"FI_PROVIDER": provider, NIXL_LOG_LEVEL_ENV: "INFO"}
    if provider == "efa":
        # vLLM forks its workers after libfabric may have registered memory: fork-safe registration
        # (a no-op on kernels from 5.13, which copy registered pages on fork; man fi_efa).
        env["FI_EFA_FORK_SAFE"] = "1"
    return env


def choose_buffer_device(kv: KVTransferSpec, pool: PoolSpec, link: HostLink) -> BufferChoice:
    """Where an engine of ``pool`` keeps the KV it hands off: in GPU memory only where the link reads it."""
    if pool.device == "cpu":
        return BufferChoice(kv.buffer_device if kv.buffer_device != "auto" else "cpu", "CPU engine")
    if kv.buffer_device != "auto":
        return BufferChoice(kv.buffer_device, "set by kv.buffer_device")
    if "LIBFABRIC" in kv.backends:
        provider, _why = libfabric_provider(kv, pool, link)
        if provider != "efa":
            return BufferChoice("cpu", f"libfabric's {provider} provider cannot read GPU memory")
        if not link.has_peermem:
            return BufferChoice("cpu", "EFA without GPUDirect RDMA (no peermem module loaded)")
        return BufferChoice("cuda", "EFA with GPUDirect RDMA (a peermem module loaded)")
    if not link.ucx_has_cuda:
        return BufferChoice("cpu", "NIXL's UCX has no cuda transports")
    return BufferChoice("cuda", "NIXL's UCX has cuda transports (cuda_ipc on one host)")



UCX_NET_DEVICES_ENV = "UCX_NET_DEVICES"
FI_TCP_IFACE_ENV = "FI_TCP_IFACE"  # libfabric's tcp provider: the one interface it uses (man fi_tcp)


def transport_env(host: str, *, kv: KVTransferSpec, pool: PoolSpec, link: HostLink) -> dict[str, str]:
    """Environment that keeps an engine's NIXL transports on the interface holding its address ``host``.

    UCX's tcp transport listens on every interface in UCX_NET_DEVICES, by default all of them: an engine at
    127.0.0.1 took KV connections on the host's external address too. UCX_NET_DEVICES names
    network devices only (tcp interfaces and RDMA ports), never shared memory, cuda_ipc or cuda_copy, so listing
    the interface and every RDMA port keeps those and InfiniBand/RoCE/EFA transports as they were. Libfabric's
    tcp provider gets FI_TCP_IFACE; its efa provider listens on no IP socket. Raises ConfigError where ``host``
    is no address of this host's interfaces."""
    interface = link.interface_of(host)
    if interface is None:
        held = ", ".join(address for address, _name in link.addresses)
        raise ConfigError(f"engine address {host!r} (launch.engine_host, or the Ray node's) is on no interface of "
                          f"this host ({held}): NIXL's transports would listen on every interface; give one of those")
    env = {UCX_NET_DEVICES_ENV: ",".join((interface, *link.rdma_ports))}
    if "LIBFABRIC" in kv.backends and libfabric_provider(kv, pool, link)[0] == "tcp":
        env[FI_TCP_IFACE_ENV] = interface
    return env
