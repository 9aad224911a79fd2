"""The memlock limit `cloud up` sets on the GPU nodes, taken where the engine reads it: the rendered NodeConfig
through what nodeadm, containerd and the kernel do to the number, then pdserve's own engine preflight on it.

Each transformation models a real tool and cites it; the last hop is real: the limit is set on a child
Python process (as runc sets the OCI spec's rlimits before the container's process runs) and CPython's own
``resource.getrlimit`` reads it there.
"""

from __future__ import annotations

import ctypes
import json
import re
import resource
import subprocess
import sys
from decimal import Decimal
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.config import load_settings
from pdserve.deploy.eksctl import GPU_NODE_GROUP, MEMLOCK_BYTES, cluster_config, unresolved_zones
from pdserve.deploy.k8s import kubernetes_settings, to_yaml
from pdserve.engines.host_checks import check_engine_host, memlock_problem
from pdserve.engines.kv_link import HostLink
from pdserve.role import Role
from tests.engines.test_host_checks import FI_INFO_OK, NIXL_CREATES, NVIDIA_SMI_L4, install

REPO = Path(__file__).parents[2]
EXAMPLE = REPO / "examples" / "eks-g6-efa.yaml"
UINT64_VALUES = 2**64
CAP_SYS_RESOURCE = 24  # linux/capability.h: raising a hard rlimit needs it (kernel/sys.c do_prlimit)
# The AMI's own process.rlimits (amazon-eks-ami nodeadm/internal/containerd/base-runtime-spec.json), the
# default nodeadm merges the NodeConfig's baseRuntimeSpec over.
AMI_DEFAULT_SPEC = {"ociVersion": "1.1.0", "process": {
    "cwd": "/", "noNewPrivileges": True, "rlimits": [{"type": "RLIMIT_NOFILE", "soft": 65536, "hard": 1048576}]}}


def rendered_node_config() -> dict[str, Any]:
    """The GPU node group's NodeConfig, from the ClusterConfig YAML `cloud up` gives eksctl (eks.plan_up)."""
    settings = load_settings(EXAMPLE)
    cluster = yaml.safe_load(to_yaml(cluster_config(settings, unresolved_zones(settings.eks))))
    (gpu,) = [group for group in cluster["managedNodeGroups"] if group["name"] == GPU_NODE_GROUP]
    node_config: dict[str, Any] = yaml.safe_load(gpu["overrideBootstrapCommand"])
    return node_config


def nodeadm_base_runtime_spec(node_config: dict[str, Any]) -> str:
    """/etc/containerd/base-runtime-spec.json as nodeadm writes it on the node.

    nodeadm decodes the NodeConfig's YAML as JSON (nodeadm/internal/api/bridge/decode.go, Kubernetes'
    UniversalDecoder), keeps baseRuntimeSpec as raw JSON (api/types.go InlineDocument), then merges it over
    the AMI's default by unmarshalling both into map[string]interface{} (containerd/base_runtime_spec.go,
    util/merge.go): Go's encoding/json makes every number there a float64 (decode.go convertNumber:
    strconv.ParseFloat), mergo overrides maps key by key and replaces lists, and json.MarshalIndent writes
    the result."""
    raw = json.dumps(node_config["spec"]["containerd"]["baseRuntimeSpec"])  # YAML -> JSON keeps the integers
    as_float64 = json.loads(raw, parse_int=float, parse_float=float)  # ParseFloat rounds as float() does
    default = json.loads(json.dumps(AMI_DEFAULT_SPEC), parse_int=float, parse_float=float)
    return go_json(mergo_override(default, as_float64))


def mergo_override(dst: Any, src: Any) -> Any:
    """dario.cat/mergo Merge WithOverride on decoded JSON: maps merge key by key, anything else (lists
    included) is replaced by src's value."""
    if isinstance(dst, dict) and isinstance(src, dict):
        return {**dst, **{key: mergo_override(dst.get(key), value) for key, value in src.items()}}
    return src


def go_json(value: Any) -> str:
    """Go's encoding/json for decoded JSON values: map keys sorted (encode.go mapEncoder), float64 as
    floatEncoder writes it: strconv's shortest round-trip digits, 'f' format (padded with zeros) from 1e-6
    up to 1e21, 'e' outside (with e-09 cleaned to e-9)."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(key)}:{go_json(value[key])}" for key in sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(go_json(item) for item in value) + "]"
    if isinstance(value, float):
        return go_float(value)
    return json.dumps(value)


def go_float(number: float) -> str:
    # Python's repr gives the shortest digits that round-trip, as Go's Ryu does; Decimal's 'e' already
    # writes exponents unpadded (1e+21, 1.5e-7), as floatEncoder leaves them
    shortest = Decimal(repr(number)).normalize()
    return f"{shortest:e}" if number != 0 and not 1e-6 <= abs(number) < 1e21 else f"{shortest:f}"


def containerd_rlimits(spec_json: str) -> dict[str, tuple[int, int]]:
    """(soft, hard) per rlimit as containerd decodes the base runtime spec (pkg/oci/spec.go ReadSpec) into the
    OCI spec, whose POSIXRlimit.Soft and .Hard are uint64 (runtime-spec specs-go/config.go). Go's decoder takes
    only an unsigned integer literal below 2^64 there, else fails with UnmarshalTypeError (decode.go
    literalStore: strconv.ParseUint), and containerd refuses the spec."""
    literals = json.loads(spec_json, parse_int=str, parse_float=str)
    return {limit["type"]: (go_uint64(limit["soft"]), go_uint64(limit["hard"]))
            for limit in literals["process"]["rlimits"]}


def go_uint64(literal: str) -> int:
    if not re.fullmatch(r"[0-9]+", literal) or int(literal) >= UINT64_VALUES:
        raise ValueError(f"json: cannot unmarshal number {literal} into Go struct field POSIXRlimit of type uint64")
    return int(literal)


class _Rlimit(ctypes.Structure):
    """struct rlimit: two rlim_t, unsigned 64-bit on Linux."""

    _fields_ = [("rlim_cur", ctypes.c_uint64), ("rlim_max", ctypes.c_uint64)]


def set_rlimit(libc: ctypes.CDLL, which: int, limits: _Rlimit) -> None:
    """setrlimit(2) with the uint64 values as runc passes them (Python's resource.setrlimit refuses values of
    2^63 and more: Modules/resource.c py2rlimit, PyLong_AsLongLong). Runs in the forked child before exec,
    so everything it uses is made before the fork."""
    if libc.setrlimit(which, ctypes.byref(limits)) != 0:
        raise OSError(ctypes.get_errno(), f"setrlimit({which})")


def can_hold(which: int, hard: int) -> bool:
    """Whether this process may give a child ``hard`` as its hard limit: lowering is always allowed,
    raising needs CAP_SYS_RESOURCE (kernel/sys.c do_prlimit)."""
    current = resource.getrlimit(which)[1] % UINT64_VALUES
    capabilities = re.search(r"^CapEff:\s*([0-9a-f]+)$", Path("/proc/self/status").read_text(), re.MULTILINE)
    effective = int(capabilities[1], 16) if capabilities else 0
    return current >= hard or bool(effective >> CAP_SYS_RESOURCE & 1)


def memlock_read_in_child(soft: int, hard: int) -> int | None:
    """``read_memlock_limit()`` in a fresh Python process started under (soft, hard).

    Where this host may not raise RLIMIT_MEMLOCK's hard limit (a container without CAP_SYS_RESOURCE), the
    child carries the values in RLIMIT_AS instead, which is unlimited here and only lowered: the kernel
    keeps every rlimit as the same rlim_t and CPython reads each through the same rlimit2py, so CPython's
    own reading is still what is tested."""
    carrier = resource.RLIMIT_MEMLOCK if can_hold(resource.RLIMIT_MEMLOCK, hard) else resource.RLIMIT_AS
    assert can_hold(carrier, hard), "no rlimit on this host can hold the value"
    script = (f"import json, resource; resource.RLIMIT_MEMLOCK = {carrier}; "
              "from pdserve.engines.host_checks import read_memlock_limit; print(json.dumps(read_memlock_limit()))")
    runc_sets_rlimits = partial(set_rlimit, ctypes.CDLL(None, use_errno=True), carrier, _Rlimit(soft, hard))
    child = subprocess.run([sys.executable, "-c", script], preexec_fn=runc_sets_rlimits, cwd=REPO,
                           capture_output=True, text=True, check=True, timeout=60)
    read: int | None = json.loads(child.stdout)
    return read


async def test_the_engine_preflight_passes_under_the_memlock_the_rendered_node_config_produces(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rlimits = containerd_rlimits(nodeadm_base_runtime_spec(rendered_node_config()))
    assert rlimits["RLIMIT_NOFILE"] == (65536, 1048576)  # the AMI's own, kept through the merge
    limit_bytes = memlock_read_in_child(*rlimits["RLIMIT_MEMLOCK"])
    # the engine's own preflight, as engine_replica.py runs it, with the pool and KV the cluster runs
    cluster = kubernetes_settings(load_settings(EXAMPLE))
    tools = tmp_path / "bin"  # stand-ins of the engine pod's fi_info, nvidia-smi and NIXL (test_host_checks.py)
    monkeypatch.setenv("PATH", f"{tools}:/usr/bin:/bin")
    install(tools, "fi_info", FI_INFO_OK)
    install(tools, "nvidia-smi", NVIDIA_SMI_L4)
    python = install(tools, "nixl-python", NIXL_CREATES)
    for role in Role:
        assert cluster.kv.backends == ["LIBFABRIC"] and cluster.kv.buffer_device == "cpu"  # g6: host staging
        checked = await check_engine_host(cluster.pool(role), kv=cluster.kv, env={"FI_PROVIDER": "efa"},
                                          link=HostLink(efa_devices=("rdmap16s27",), has_peermem=False),
                                          python=python, memlock_limit_bytes=limit_bytes)
        assert checked.startswith("memlock 8388608.0 GiB, fi_info efa"), checked
    assert rlimits["RLIMIT_MEMLOCK"] == (MEMLOCK_BYTES, MEMLOCK_BYTES), "the number changed on its way"


def test_rlim_infinity_would_not_reach_the_container() -> None:
    """Why the limit is not RLIM_INFINITY: it comes back from the float64 merge above 2^64."""
    node_config = rendered_node_config()
    rlimits = node_config["spec"]["containerd"]["baseRuntimeSpec"]["process"]["rlimits"]
    infinity = [{**limit, "soft": UINT64_VALUES - 1, "hard": UINT64_VALUES - 1} for limit in rlimits]
    node_config["spec"]["containerd"]["baseRuntimeSpec"]["process"]["rlimits"] = infinity
    spec_json = nodeadm_base_runtime_spec(node_config)
    assert '"hard":18446744073709552000' in spec_json
    with pytest.raises(ValueError, match="cannot unmarshal number 18446744073709552000"):
        containerd_rlimits(spec_json)


@pytest.mark.parametrize(("soft", "expected"), [
    (9223372036854776000, 9223372036854776000),  # what 2^63-1 became on the way (9a77e7e's NodeConfig)
    (UINT64_VALUES - 1, None),  # RLIM_INFINITY, which CPython reads as -1
    (4 * 2**20, 4 * 2**20),  # below the usual 8 MiB: RLIMIT_MEMLOCK itself, lowered, on any host
])
def test_a_limit_of_2_63_or_more_reads_as_the_kernels_unsigned_value(soft: int, expected: int | None) -> None:
    read = memlock_read_in_child(soft, soft)
    assert read == expected
    problem = memlock_problem(read, needed_bytes=20 * 2**30, what="the KV staging buffer")
    assert (problem is None) == (soft > 20 * 2**30), problem
