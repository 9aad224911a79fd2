"""Judge what the probes measured: link expectations, pass/fail, and what to change. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pdserve.engine_config import PoolSpec
from pdserve.engines.kv_path import KvPath
from pdserve.pd.slow_kv import KvBar
from pdserve.verify.probe import HandoffProbe


class Link(StrEnum):
    HOST_MEMORY = "host-memory"  # KV buffers in host memory on one host: CPU engines, or GPU engines staging it
    SAME_GPU = "same-gpu"
    GPU_TO_GPU = "gpu-to-gpu"  # two GPUs of one host: NVLink, else PCIe
    NETWORK = "network"  # engines on other hosts: EFA/RDMA, else TCP


# What each link can move, GB/s. Host memory is measured on the spot instead.
NOMINAL_GBPS = {
    # What a KV handoff inside one GPU moves over UCX's cuda_ipc when two engines share it under MPS: one
    # NIXL descriptor per block (and per layer), not one copy. Healthy handoffs of 156-453 MB measured
    # 120-210 GB/s on an H200; host staging or TCP moves 0.01-4 GB/s (docs/transport.md). Against the
    # device's own 1,800 GB/s copy, a healthy pair fell under the 10% bar.
    Link.SAME_GPU: 150.0,
    Link.GPU_TO_GPU: 450.0,  # NVLink 4, one direction
    Link.NETWORK: 12.5,  # 100 Gb/s
}

# What one transfer may take beyond its bytes at the bar, unblamed on the link, ms. The decode engine
# sees a transfer finish only when it next polls NIXL, between its steps: on a busy CPU host that is
# milliseconds, longer than the CPU demo's 2 MB probe takes to copy (0.3-5 ms measured on 2 cores,
# docs/transport.md section 7). GPU probes move 100+ MB, so there the bytes decide. Against a bar the
# user gave (--expected-gbps) none is allowed: 5 ms is more than a 2 MB probe takes at any bar over 0.4 GB/s.
SLACK_MS = {Link.HOST_MEMORY: 5.0}

ADVICE = {
    Link.HOST_MEMORY: "CPU engines: keep kv.buffer_device=cpu; check UCX picked shm/cma, not tcp (UCX_TLS)",
    Link.SAME_GPU: "GPU engines: UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (set by pdserve) and a UCX with cuda_ipc; "
                   "see docs/transport.md",
    Link.GPU_TO_GPU: "check UCX lists cuda_ipc and that the GPUs see each other (nvidia-smi topo -m)",
    Link.NETWORK: "check the link between the engines (a shaped or degraded interface, its speed, its MTU), "
                  "and use NIXL's LIBFABRIC backend on EFA (kv.backends), or UCX with rc/ib; TCP is the slow path",
}


@dataclass(frozen=True, slots=True)
class Verdict:
    link: Link
    expected_gbps: float
    measured_gbps: float  # bytes / the engine's own NIXL transfer time
    handoff_gbps: float  # bytes / the whole decode leg (pull + one decode step)
    problems: tuple[str, ...]

    @property
    def is_ok(self) -> bool:
        return not self.problems


def classify_link(prefill: PoolSpec, decode: PoolSpec, *, prefill_host: str, decode_host: str,
                  buffer_devices: tuple[str, str] = ("", "")) -> Link:
    """Which link a pair's KV cache crosses, from where the pools' engines run, the hosts of the two
    engines (loopback addresses are all this host) and where each engine said its KV buffer is ("" when
    it did not): GPU engines that stage their KV in host memory move it host to host."""
    if not (prefill_host == decode_host or (_is_loopback(prefill_host) and _is_loopback(decode_host))):
        return Link.NETWORK
    if (prefill.device == "cpu" and decode.device == "cpu") or buffer_devices == ("cpu", "cpu"):
        return Link.HOST_MEMORY
    if prefill.device == "cuda" and decode.device == "cuda" and set(prefill.gpu_ids) == set(decode.gpu_ids):
        return Link.SAME_GPU
    return Link.GPU_TO_GPU


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.")


def judge(probe: HandoffProbe, *, link: Link, expected_gbps: float, min_fraction: float,
          slack_ms: float | None = None, is_bar_given: bool = False, via: str = "") -> Verdict:
    """Fail when no KV arrived over the connector, a transfer failed, or it ran too slowly by the
    gateway's rule (pd/slow_kv.py): longer than its bytes take at ``min_fraction`` of the link plus
    ``slack_ms`` a transfer (default: by link, or none where the user gave the link's rate,
    ``is_bar_given``). ``via``: the interface the link was judged by (verify/interface.py), named in the verdict."""
    engine = probe.engine
    problems = []
    if engine.transfers < 1 or engine.bytes <= 0:
        problems.append("the decode engine counted no KV transfer: it recomputed the prompt (is the KV "
                        "connector configured on both engines?)")
    elif engine.external_tokens < probe.prompt_tokens - 1 - 32:  # the last partial block may be recomputed
        problems.append(f"only {engine.external_tokens:.0f} of {probe.prompt_tokens} prompt tokens arrived over "
                        "the KV connector")
    if engine.failed:
        problems.append(f"{engine.failed:.0f} KV transfer(s) failed")
    measured_gbps = engine.gbps
    slack = (0.0 if is_bar_given else SLACK_MS.get(link, 0.0)) if slack_ms is None else slack_ms
    if engine.bytes > 0 and KvBar(gbps=min_fraction * expected_gbps, allowance_ms=slack).is_slow(engine):
        allowing = f", allowing {slack:g} ms a transfer" if slack else ""
        through = f" through {via}" if via else ""
        problems.append(f"KV moved at {measured_gbps:.3g} GB/s, under {min_fraction:.0%} of the {link.value} "
                        f"link's {expected_gbps:.3g} GB/s{through}{allowing}. {ADVICE[link]}")
    handoff_gbps = engine.bytes / probe.decode_s / 1e9 if probe.decode_s > 0 else 0.0
    return Verdict(link=link, expected_gbps=expected_gbps, measured_gbps=measured_gbps,
                   handoff_gbps=handoff_gbps, problems=tuple(problems))


EFA_ADVICE = ("EFA was asked for (placement.efa_devices or kv.libfabric_provider: efa): set kv.backends: [LIBFABRIC], "
              "run the engines where `fi_info -p efa` lists a device (the vpc.amazonaws.com/efa resource on EKS), "
              "and leave FI_PROVIDER out of the pools' env")


def kv_path_problems(path: KvPath, *, role: str, url: str, is_efa_asked: bool, link: Link) -> list[str]:
    """What is wrong with the KV path one engine logged: not EFA where EFA was asked for; UCX reading KV
    over TCP between two engines of one host (shared memory, cma or cuda_ipc are the paths there), which a
    rate bar alone may pass where the host's own copy is slow."""
    problems = []
    if is_efa_asked and path.provider != "efa":
        got = f"LIBFABRIC over {path.provider or 'a provider NIXL did not report'}" if "LIBFABRIC" in path.backends \
            else "+".join(path.backends)
        problems.append(f"{role} engine {url} moves KV over {got}, not EFA. {EFA_ADVICE}")
    over_tcp = [transport for transport in path.transports if transport.startswith("tcp")]
    if link is not Link.NETWORK and over_tcp:
        problems.append(f"{role} engine {url} reads KV over {over_tcp[0]} between engines of one host. {ADVICE[link]}")
    return problems
