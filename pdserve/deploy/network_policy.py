"""Pure: cluster-ready Settings -> the NetworkPolicies that close the namespace to everything but pdserve's own
flows (docs/deploy.md, "Network policies", lists each). Ingress only; no I/O.

Every pod of the namespace first denies all ingress; then each policy lets one group of pods be reached on its
ports by the peers that must: clients the gateway, the gateway the engines' HTTP, engines each other's KV path,
Ray pods each other's Ray ports, the KubeRay operator the dashboard, Prometheus the engines' /metrics. A pod's
own node always reaches it (the kubelet's probes: the VPC CNI's agent admits the node's IP,
aws-network-policy-agent pkg/fwruleprocessor/fw_rule_processor.go); ``kubectl port-forward`` enters the pod
from inside, past every policy.
"""

from __future__ import annotations

from typing import Any

from pdserve.cluster_config import KubernetesSpec
from pdserve.config import Settings
from pdserve.deploy.k8s_names import (
    HEAD_COMPONENT,
    RAY_AGENT_HTTP_PORT,
    RAY_HEAD_PORTS,
    RAY_NODE_PORTS,
    RAY_WORKER_PORTS,
    UCX_TCP_PORTS,
    component_selector,
    engine_selector,
    gateway_selector,
    object_metadata,
    ray_selector,
)
from pdserve.role import Role

KUBERAY_OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}  # its Helm chart's (_helpers.tpl)
PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}  # every Prometheus pod of the Prometheus Operator's
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server
Port = int | tuple[int, int]  # one port, or a range first..last


def network_policies(settings: Settings) -> list[dict[str, Any]]:
    """Default-deny, then one policy per group of pods with exactly the flows it must accept."""
    spec = settings.kubernetes
    return [
        _policy(spec, "default-deny", {}, []),
        _policy(spec, "gateway", {"matchLabels": gateway_selector(spec)}, [_rule([], [settings.gateway.port])]),
        _policy(spec, HEAD_COMPONENT, component_selector(spec, HEAD_COMPONENT), [
            _rule([_pods(ray_selector(spec))], [RAY_HEAD_PORTS["gcs-server"]]),
            _rule([_peer(spec.kuberay_namespace, KUBERAY_OPERATOR_LABELS)], [RAY_HEAD_PORTS["dashboard"]]),
        ]),
        _policy(spec, "ray", ray_selector(spec), [_rule([_pods(ray_selector(spec))], ray_ports())]),
        *(_engine_http_policy(settings, role) for role in Role),
        _policy(spec, "kv", engine_selector(spec), [_rule([_pods(engine_selector(spec))], kv_ports(settings))]),
    ]


def ray_ports() -> list[Port]:
    """What Ray pods reach on each other: raylet, object manager, dashboard agent (gRPC, HTTP), workers."""
    workers = (RAY_WORKER_PORTS["min-worker-port"], RAY_WORKER_PORTS["max-worker-port"])
    return [*RAY_NODE_PORTS.values(), RAY_AGENT_HTTP_PORT, workers]


def kv_ports(settings: Settings) -> list[Port]:
    """NIXL's side channel of each pool's engines (one engine per pod: its rank-0 port, ray/engine_replica.py),
    and UCX's TCP transport where UCX carries the KV. EFA carries it outside IP, so no policy applies there."""
    base = settings.kv.side_channel_base_port
    side_channels: list[Port] = [base, base + 1]  # prefill, decode
    return [*side_channels, UCX_TCP_PORTS] if "UCX" in settings.kv.backends else side_channels


def _engine_http_policy(settings: Settings, role: Role) -> dict[str, Any]:
    """A pool's engine API: the gateway's legs and probes, and Prometheus for /metrics (the engine key guards both)."""
    spec = settings.kubernetes
    peers = [_pods({"matchLabels": gateway_selector(spec)}), _peer(spec.prometheus_namespace, PROMETHEUS_LABELS)]
    return _policy(spec, role.value, component_selector(spec, role.value),
                   [_rule(peers, [settings.pool(role).base_port])])


def _policy(spec: KubernetesSpec, name: str, pods: dict[str, Any], ingress: list[dict[str, Any]]) -> dict[str, Any]:
    """A NetworkPolicy of this deployment that isolates ``pods`` for ingress and admits ``ingress``."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_metadata(spec, f"{spec.name}-{name}", "network-policy"),
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _rule(peers: list[dict[str, Any]], ports: list[Port]) -> dict[str, Any]:
    """Admit ``peers`` (none: anyone) on TCP ``ports``."""
    ports_only = {"ports": [_port(port) for port in ports]}
    return {"from": peers, **ports_only} if peers else ports_only


def _port(port: Port) -> dict[str, Any]:
    if isinstance(port, int):
        return {"protocol": "TCP", "port": port}
    return {"protocol": "TCP", "port": port[0], "endPort": port[1]}


def _pods(selector: dict[str, Any]) -> dict[str, Any]:
    """Pods of this namespace."""
    return {"podSelector": selector}


def _peer(namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    """Pods labelled ``labels`` in ``namespace`` only: a label alone could be put on a pod of any namespace."""
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}},
            "podSelector": {"matchLabels": labels}}

