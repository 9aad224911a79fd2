"""Pure: Settings -> the eksctl ClusterConfig of pdserve's EKS cluster, and the zones it lives in.

The GPU node group sits in ONE availability zone: EFA traffic does not cross zones. No I/O:
``zone_query`` is the command that lists the zones, ``choose_zones`` reads its output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.config import EksSpec, Settings
from pdserve.deploy.rayservice import GPU_RESOURCE
from pdserve.errors import ConfigError, DeployError
from pdserve.role import Role

SYSTEM_NODE_GROUP = "system"
GPU_NODE_GROUP = "gpu"
# The taint's key is the resource's name, so EKS's ExtendedResourceToleration admission gives every
# pod that requests a GPU the toleration by itself, and nothing else lands on the GPU nodes.
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "true", "effect": "NoSchedule"}


@dataclass(frozen=True, slots=True)
class Zones:
    """Where the cluster goes: the GPU node group's one zone, and the zones of the control plane
    (EKS wants subnets in two zones at least) and of the system node group."""

    gpu: str
    cluster: tuple[str, ...]
    system: tuple[str, ...]


def zone_query(eks: EksSpec) -> tuple[str, ...]:
    """The read-only AWS call listing which zones of the region offer the two instance types."""
    types = f"{eks.gpu_instance_type},{eks.system_instance_type}"
    return ("aws", "ec2", "describe-instance-type-offerings", "--location-type", "availability-zone",
            "--filters", f"Name=instance-type,Values={types}", "--region", eks.region, "--output", "json")


def choose_zones(offerings_json: str, eks: EksSpec) -> Zones:
    """Zones from ``zone_query``'s output: the configured GPU zone, or else the first (sorted) that
    offers the GPU type, plus another zone offering the system type. Raises DeployError when the
    region cannot host the cluster, naming the zones it does offer."""
    offered = _zones_by_type(offerings_json)
    gpu_zones = offered.get(eks.gpu_instance_type, [])
    system_zones = offered.get(eks.system_instance_type, [])
    gpu = eks.availability_zone or (gpu_zones[0] if gpu_zones else "")
    if gpu not in gpu_zones:
        where = f"zone {gpu}" if gpu else f"region {eks.region}"
        raise DeployError(f"{eks.gpu_instance_type} is not offered in {where} "
                          f"(offered in: {', '.join(gpu_zones) or 'none'}); set eks.availability_zone or eks.region")
    others = [zone for zone in system_zones if zone != gpu]
    if not others:
        raise DeployError(f"EKS needs a second zone in {eks.region} offering {eks.system_instance_type}; "
                          f"offered in: {', '.join(system_zones) or 'none'}")
    cluster = (gpu, others[0])
    return Zones(gpu=gpu, cluster=cluster, system=tuple(zone for zone in cluster if zone in system_zones))


def unresolved_zones(eks: EksSpec) -> Zones:
    """Stand-ins a dry run shows where ``cloud up`` would put the zones ``zone_query`` returns."""
    gpu = eks.availability_zone or f"<first zone offering {eks.gpu_instance_type}>"
    other = f"<another zone offering {eks.system_instance_type}>"
    return Zones(gpu=gpu, cluster=(gpu, other), system=(gpu, other))


def cluster_config(settings: Settings, zones: Zones) -> dict[str, Any]:
    """The ClusterConfig ``eksctl create cluster|nodegroup -f -`` reads: a system node group labelled
    for the Ray head, and an EFA GPU node group labelled for the engine pools. Raises ConfigError
    when the two pools ask for different values of one node label."""
    eks = settings.eks
    return {
        "apiVersion": "eksctl.io/v1alpha5",
        "kind": "ClusterConfig",
        "metadata": {"name": eks.cluster_name, "region": eks.region, "version": eks.kubernetes_version},
        "availabilityZones": list(zones.cluster),
        "managedNodeGroups": [
            {"name": SYSTEM_NODE_GROUP, "instanceType": eks.system_instance_type, **_size(eks.system_nodes),
             "availabilityZones": list(zones.system), "labels": _labels_to_set(
                 settings.kubernetes.head_node_labels, instance_type=eks.system_instance_type,
                 field="kubernetes.head_node_labels")},
            {"name": GPU_NODE_GROUP, "instanceType": eks.gpu_instance_type, **_size(eks.gpu_nodes),
             "availabilityZones": [zones.gpu], "labels": gpu_node_labels(settings), "taints": [GPU_TAINT],
             "volumeSize": eks.gpu_volume_gib, "efaEnabled": eks.efa,
             # an instance with EFA interfaces cannot take a public address: its nodes reach out via NAT
             "privateNetworking": eks.efa},
        ],
    }


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
