"""Pure: Settings -> the eksctl ClusterConfig of pdserve's EKS cluster, and the zones it lives in.

The GPU node group sits in ONE availability zone: EFA traffic does not cross zones. No I/O:
``zone_query`` is the command that lists the zones, ``choose_zones`` reads its output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

from pdserve.cluster_config import EksSpec
from pdserve.config import Settings
from pdserve.deploy.rayservice import GPU_RESOURCE
from pdserve.deploy.steps import Readiness
from pdserve.errors import ConfigError, DeployError
from pdserve.role import Role

SYSTEM_NODE_GROUP = "system"
# The VPC CNI enforces NetworkPolicies only when its add-on is configured to (enableNetworkPolicy: "true", a string in
# the add-on's configuration schema); otherwise `render k8s`'s policies are accepted and enforce nothing. eksctl
# creates the add-ons listed in `addons` with the cluster, before the node groups, and adds the default ones
# (kube-proxy, coredns, ...) beside it (eksctl pkg/actions/addon/tasks.go, CreateAddonTasks; KnownAddons in
# pkg/apis/eksctl.io/v1alpha5/known_addons.go); `configurationValues` is a JSON or YAML string
# (pkg/apis/eksctl.io/v1alpha5/addon.go); `overwrite` takes over the self-managed aws-node EKS may have installed.
VPC_CNI_ADDON = {"name": "vpc-cni", "configurationValues": json.dumps({"enableNetworkPolicy": "true"}),
                 "resolveConflicts": "overwrite"}
GPU_NODE_GROUP = "gpu"
# The taint's key is the resource's name, so EKS's ExtendedResourceToleration admission gives every
# pod that requests a GPU the toleration by itself, and nothing else lands on the GPU nodes.
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "true", "effect": "NoSchedule"}
# Every container on an AL2023 node gets the rlimits of containerd's base runtime spec, which sets only
# RLIMIT_NOFILE (amazon-eks-ami, nodeadm/internal/containerd/base-runtime-spec.json), so memlock stays at
# the runtime's small default; capabilities such as IPC_LOCK are not effective for the Ray images' non-root
# user. NIXL pins the KV buffer (GiBs) and libfabric its own buffers: the GPU nodes raise memlock for every
# container through nodeadm's NodeConfig (spec.containerd.baseRuntimeSpec, merged over the default spec;
# lists replace, so NOFILE is repeated at the AMI's values).
# The number travels: nodeadm merges the spec by decoding JSON into map[string]interface{}, so every
# number becomes a float64 (amazon-eks-ami nodeadm/internal/containerd/base_runtime_spec.go,
# nodeadm/internal/util/merge.go), and writes it back with Go's encoding/json (encode.go floatEncoder:
# strconv's shortest digits, 'f' format below 1e21, padded with zeros); containerd decodes that file into
# the OCI spec, whose rlimits are uint64 (containerd pkg/oci/spec.go ReadSpec, runtime-spec specs-go/config.go
# POSIXRlimit), and the kernel keeps them; CPython reads them back as a signed C long (Modules/resource.c
# rlimit2py). 2^63-1 came back as 9223372036854776000, above 2^63, which CPython reads as negative;
# RLIM_INFINITY (2^64-1) would come back above 2^64 and fail containerd's uint64 decoding. 2^53 bytes (8 PiB)
# is an integer float64 holds exactly, which Go writes back digit for digit, positive as a signed 64-bit
# value, and "unlimited" for any buffer a host can pin (tests/deploy/test_memlock_path.py follows it).
MEMLOCK_BYTES = 2**53
NOFILE_LIMITS = {"soft": 65536, "hard": 1048576}


@dataclass(frozen=True, slots=True)
class Zones:
    """Where the cluster goes: the zones the GPU node group may use, in the order ``cloud up`` tries them (one
    at a time: EFA traffic does not cross zones), and the zones of the control plane (a subnet in every GPU
    zone, and two zones at least, as EKS wants) and of the system node group."""

    gpu: tuple[str, ...]
    cluster: tuple[str, ...]
    system: tuple[str, ...]


def zone_query(eks: EksSpec) -> tuple[str, ...]:
    """The read-only AWS call listing which zones of the region offer the two instance types."""
    types = f"{eks.gpu_instance_type},{eks.system_instance_type}"
    return ("aws", "ec2", "describe-instance-type-offerings", "--location-type", "availability-zone",
            "--filters", f"Name=instance-type,Values={types}", "--region", eks.region, "--output", "json")


def choose_zones(offerings_json: str, eks: EksSpec) -> Zones:
    """Zones from ``zone_query``'s output: the configured GPU zones, or else every zone (sorted) that offers
    the GPU type, plus another zone offering the system type where they are fewer than two or none offers
    it. eksctl makes the cluster's subnets in its ``availabilityZones`` only, and a node group can use only
    those, so every zone the GPU group may move to is among them. Raises DeployError when the region cannot
    host the cluster, naming the zones it does offer."""
    offered = _zones_by_type(offerings_json)
    gpu_zones = offered.get(eks.gpu_instance_type, [])
    system_zones = offered.get(eks.system_instance_type, [])
    missing = [zone for zone in eks.availability_zones if zone not in gpu_zones]
    if missing or not gpu_zones:
        where = f"zone {', '.join(missing)}" if missing else f"region {eks.region}"
        raise DeployError(f"{eks.gpu_instance_type} is not offered in {where} (offered in: {', '.join(gpu_zones) or 'none'}); "
                          "set eks.availability_zones or eks.region")
    gpu = tuple(eks.availability_zones or gpu_zones)
    cluster = list(gpu)
    if len(cluster) < 2 or not set(cluster) & set(system_zones):
        others = [zone for zone in system_zones if zone not in cluster]
        if not others:
            raise DeployError(f"EKS needs a second zone in {eks.region} offering {eks.system_instance_type}; "
                              f"offered in: {', '.join(system_zones) or 'none'}")
        cluster.append(others[0])
    return Zones(gpu=gpu, cluster=tuple(cluster), system=tuple(zone for zone in cluster if zone in system_zones))


def unresolved_zones(eks: EksSpec) -> Zones:
    """Stand-ins a dry run shows where ``cloud up`` would put the zones ``zone_query`` returns."""
    offering = f"offering {eks.gpu_instance_type}"
    gpu = tuple(eks.availability_zones) or (f"<first zone {offering}>", f"<each other zone {offering}, in turn>")
    other = f"<a zone offering {eks.system_instance_type}, where needed>"
    return Zones(gpu=gpu, cluster=(*gpu, other), system=(*gpu, other))


def cluster_config(settings: Settings, zones: Zones, *, gpu_zone: str = "") -> dict[str, Any]:
    """The ClusterConfig ``eksctl create cluster|nodegroup -f -`` reads: the VPC CNI enforcing NetworkPolicies,
    a system node group labelled for the Ray head, and an EFA GPU node group labelled for the engine pools, in
    ``gpu_zone`` (default: the first GPU zone). Raises ConfigError when the node groups cannot serve the pools (check_efa_node_group,
    check_room_for_upgrades, and the node labels of both groups)."""
    eks = settings.eks
    check_efa_node_group(settings)
    check_room_for_upgrades(settings)
    return {
        "apiVersion": "eksctl.io/v1alpha5",
        "kind": "ClusterConfig",
        "metadata": {"name": eks.cluster_name, "region": eks.region, "version": eks.kubernetes_version},
        "availabilityZones": list(zones.cluster),
        "addons": [VPC_CNI_ADDON],
        "managedNodeGroups": [
            {"name": SYSTEM_NODE_GROUP, "instanceType": eks.system_instance_type, **_size(eks.system_nodes),
             "availabilityZones": list(zones.system), "labels": head_node_labels(settings)},
            {"name": GPU_NODE_GROUP, "instanceType": eks.gpu_instance_type, **_size(eks.gpu_nodes),
             "availabilityZones": [gpu_zone or zones.gpu[0]], "labels": gpu_node_labels(settings), "taints": [GPU_TAINT],
             "volumeSize": eks.gpu_volume_gib, "efaEnabled": eks.efa,
             # an instance with EFA interfaces cannot take a public address: its nodes reach out via NAT
             "privateNetworking": eks.efa, **_memlock_bootstrap(eks)},
        ],
    }


def check_efa_node_group(settings: Settings) -> None:
    """Raises ConfigError when a pool asks for EFA devices the GPU node group would not offer."""
    asking = [role.value for role in Role if settings.pool(role).placement.efa_devices]
    if asking and not settings.eks.efa:
        raise ConfigError(f"{asking[0]}.placement.efa_devices asks for EFA but eks.efa is false: the GPU node group "
                          "would offer none and the engine pods would never be scheduled")


def check_room_for_upgrades(settings: Settings) -> None:
    """KubeRay's NewCluster upgrade runs a second set of engine pods beside the first, one per GPU node:
    raises ConfigError when the GPU node group has no room for them."""
    gpu_pods = sum(settings.pool(role).engines for role in Role if settings.pool(role).device == "cuda")
    if settings.kubernetes.upgrade == "new_cluster" and settings.eks.gpu_nodes < 2 * gpu_pods:
        raise ConfigError(f"kubernetes.upgrade: new_cluster starts {gpu_pods} more engine pods during an upgrade, "
                          f"but eks.gpu_nodes is {settings.eks.gpu_nodes} (needs {2 * gpu_pods}); use recreate")


def gpu_node_config() -> dict[str, Any]:
    """nodeadm's NodeConfig that lifts RLIMIT_MEMLOCK for every container on a GPU node (AL2023)."""
    rlimits = [{"type": "RLIMIT_NOFILE", **NOFILE_LIMITS},
               {"type": "RLIMIT_MEMLOCK", "soft": MEMLOCK_BYTES, "hard": MEMLOCK_BYTES}]
    return {"apiVersion": "node.eks.aws/v1alpha1", "kind": "NodeConfig",
            "spec": {"containerd": {"baseRuntimeSpec": {"process": {"rlimits": rlimits}}}}}


def _memlock_bootstrap(eks: EksSpec) -> dict[str, str]:
    """On AL2023, eksctl takes ``overrideBootstrapCommand`` as a NodeConfig and adds it to the node group's
    user data beside EKS's own (eksctl pkg/nodebootstrap/al2023.go), so the kubelet's settings stay EKS's."""
    if not eks.efa:
        return {}
    return {"amiFamily": "AmazonLinux2023", "overrideBootstrapCommand": yaml.safe_dump(gpu_node_config(), sort_keys=False)}


def gpu_node_labels(settings: Settings) -> dict[str, str]:
    """One GPU node group serves both pools, so its nodes carry every label either pool selects.

    Raises ConfigError when the pools want different values of one label, or select another
    instance type than the group's."""
    labels: dict[str, str] = {}
    for role in Role:
        for key, value in settings.pool(role).placement.node_labels.items():
            if labels.setdefault(key, value) != value:
                raise ConfigError(f"prefill.placement.node_labels and decode.placement.node_labels set {key} to "
                                  f"{labels[key]!r} and {value!r}; one GPU node group carries one value per label")
    return _labels_to_set(labels, instance_type=settings.eks.gpu_instance_type, field="placement.node_labels")


def head_node_labels(settings: Settings) -> dict[str, str]:
    """The labels the system node group carries for the Ray head's nodeSelector. Raises ConfigError when
    it selects another instance type than the group's."""
    return _labels_to_set(settings.kubernetes.head_node_labels, instance_type=settings.eks.system_instance_type,
                          field="kubernetes.head_node_labels")


def _labels_to_set(selector: dict[str, str], *, instance_type: str, field: str) -> dict[str, str]:
    """The labels a node group must add for ``selector`` to match its nodes. Kubernetes' own labels
    (``*kubernetes.io/``, ``*k8s.io/``) are the kubelet's to set; only the instance type is checked."""
    selected_type = selector.get(INSTANCE_TYPE_LABEL, instance_type)
    if selected_type != instance_type:
        raise ConfigError(f"{field}: selects {INSTANCE_TYPE_LABEL}={selected_type} but the node group runs "
                          f"{instance_type}; no pod would be scheduled")
    return {key: value for key, value in selector.items() if not _is_kubernetes_label(key)}


def _is_kubernetes_label(key: str) -> bool:
    domain = key.partition("/")[0] if "/" in key else ""
    return any(domain == root or domain.endswith("." + root) for root in ("kubernetes.io", "k8s.io"))


def _size(nodes: int) -> dict[str, int]:
    """A fixed size: engines are placed by Ray Serve, not by a node autoscaler."""
    return {"desiredCapacity": nodes, "minSize": nodes, "maxSize": nodes}


def _zones_by_type(offerings_json: str) -> dict[str, list[str]]:
    try:
        offerings = json.loads(offerings_json)["InstanceTypeOfferings"]
        pairs = [(offering["InstanceType"], offering["Location"]) for offering in offerings]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DeployError(f"unexpected output from aws ec2 describe-instance-type-offerings: {exc!r}") from exc
    zones: dict[str, list[str]] = {}
    for instance_type, zone in sorted(pairs):
        zones.setdefault(instance_type, []).append(zone)
    return zones


# EKS DescribeNodegroup's statuses (aws-sdk-go-v2 service/eks/types NodegroupStatus).
NODE_GROUP_ACTIVE = "ACTIVE"
_NODE_GROUP_BUSY = ("CREATING", "UPDATING", "DELETING")


def node_group_state(output_json: str, *, eks: EksSpec, name: str) -> Readiness:
    """Done when ``eksctl get nodegroup --name NAME -o json`` (a JSON array of summaries, exit 0 for a node
    group in any state: eksctl pkg/actions/nodegroup/get.go) shows it ACTIVE; a node group that failed,
    or is being changed by someone else, stops ``cloud up`` with what to do."""
    try:
        statuses = [str(summary.get("Status", "")) for summary in json.loads(output_json) if summary.get("Name") == name]
    except (json.JSONDecodeError, AttributeError, TypeError) as exc:
        raise DeployError(f"unexpected output from eksctl get nodegroup: {exc!r}") from exc
    if not statuses:
        return Readiness(is_ready=False, summary="absent")
    status = statuses[0]
    if status == NODE_GROUP_ACTIVE:
        return Readiness(is_ready=True, summary=status)
    where = f"--cluster {eks.cluster_name} --region {eks.region}"
    if status in _NODE_GROUP_BUSY:
        return Readiness(is_ready=False, summary=status, blocker=(
            f"node group {name} is {status}: another eksctl or the console is changing it. Wait until "
            f"`eksctl get nodegroup {where} --name {name}` shows {NODE_GROUP_ACTIVE}, then run `pdserve cloud up` again"))
    return Readiness(is_ready=False, summary=status, blocker=(
        f"node group {name} exists but is {status}, so its nodes cannot be relied on. Read why with `aws eks "
        f"describe-nodegroup --cluster-name {eks.cluster_name} --nodegroup-name {name} --region {eks.region} --query "
        f"nodegroup.health`, fix the cause (quota, capacity in the zone, subnets), remove it with `eksctl delete "
        f"nodegroup {where} --name {name} --wait`, then run `pdserve cloud up` again"))


# EC2's error code when a zone has no instances of the type to spare. EKS passes it on in the node group's
# health (issue code AsgInstanceLaunchFailures, "Could not launch On-Demand Instances.
# InsufficientInstanceCapacity - We currently do not have sufficient ... capacity in the Availability Zone you
# requested ...": aws/containers-roadmap#2204), and CloudFormation in the failed stack event's reason
# ("Resource handler returned message: \"[Issue(Code=AsgInstanceLaunchFailures, Message=...)]\"").
INSUFFICIENT_CAPACITY = "InsufficientInstanceCapacity"


def capacity_cause(output: str, *, instance_type: str) -> str:
    """'' unless ``output`` (eksctl's, and ``node_group_failure_reads``') says EC2 had no capacity."""
    if INSUFFICIENT_CAPACITY not in output:
        return ""
    return f"EC2 has no {instance_type} to spare in that zone ({INSUFFICIENT_CAPACITY})"


def node_group_failure_reads(eks: EksSpec, *, name: str) -> tuple[tuple[str, ...], ...]:
    """Read-only commands that say why ``eksctl create nodegroup`` failed: eksctl prints only "failed to create
    nodegroups" (eksctl pkg/actions/nodegroup/create.go). The node group's health, while it still exists; the
    CREATE_FAILED events of its CloudFormation stack (eksctl pkg/cfn/manager/nodegroup.go names it
    eksctl-CLUSTER-nodegroup-NAME), which stay after the stack has rolled back and removed the group."""
    return (
        ("aws", "eks", "describe-nodegroup", "--cluster-name", eks.cluster_name, "--nodegroup-name", name,
         "--region", eks.region, "--query", "nodegroup.health", "--output", "json"),
        ("aws", "cloudformation", "describe-stack-events", "--stack-name", f"eksctl-{eks.cluster_name}-nodegroup-{name}",
         "--region", eks.region, "--query", "StackEvents[?ResourceStatus=='CREATE_FAILED'].ResourceStatusReason",
         "--output", "json"),
    )
