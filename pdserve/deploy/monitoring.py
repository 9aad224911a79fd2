"""Pure: cluster-ready Settings -> the objects that watch a deployment: PodMonitors for the
Prometheus Operator (the gateway's and the engines' /metrics) and the Grafana dashboard as a
ConfigMap for Grafana's dashboard sidecar. Reads the packaged dashboard JSON; writes nothing.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from pdserve.cluster_config import KubernetesSpec
from pdserve.config import Settings
from pdserve.deploy.k8s_names import (
    ENGINE_PORT_NAME,
    GATEWAY_PORT_NAME,
    gateway_selector,
    object_labels,
    object_metadata,
)
from pdserve.role import Role

METRICS_INTERVAL = "15s"
DASHBOARD_FILE = "pdserve.json"
# The label Grafana's sidecar (kube-prometheus-stack, the grafana Helm chart) looks for by default.
GRAFANA_SIDECAR_LABEL = {"grafana_dashboard": "1"}
# Copied onto every engine series, so the dashboard can tell prefill from decode engines.
POD_ROLE_LABEL = "__meta_kubernetes_pod_label_app_kubernetes_io_component"


def dashboard_json() -> str:
    """The Grafana dashboard over pdserve's and vLLM's metrics, as shipped in the package."""
    return resources.files("pdserve.deploy").joinpath("dashboards", DASHBOARD_FILE).read_text(encoding="utf-8")


def gateway_pod_monitor(settings: Settings) -> dict[str, Any]:
    """Tells the Prometheus Operator to scrape the gateway's /metrics on the head pod."""
    spec = settings.kubernetes
    endpoint = {"port": GATEWAY_PORT_NAME, "path": "/metrics", "interval": METRICS_INTERVAL}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _monitor_metadata(spec, f"{spec.name}-gateway", "gateway"),
        "spec": {"selector": {"matchLabels": gateway_selector(spec)}, "podMetricsEndpoints": [endpoint]},
    }


def engine_pod_monitor(settings: Settings) -> dict[str, Any]:
    """Tells the Prometheus Operator to scrape every engine's own vLLM /metrics on the worker pods,
    with the pod's pool as a ``role`` label (prefill or decode)."""
    spec = settings.kubernetes
    role_label = {"sourceLabels": [POD_ROLE_LABEL], "targetLabel": "role", "action": "replace"}
    endpoint = {"port": ENGINE_PORT_NAME, "path": "/metrics", "interval": METRICS_INTERVAL,
                "relabelings": [role_label]}
    selector = {
        "matchLabels": {"app.kubernetes.io/instance": spec.name},
        "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                              "values": [role.value for role in Role]}],
    }
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _monitor_metadata(spec, f"{spec.name}-engines", "engines"),
        "spec": {"selector": selector, "podMetricsEndpoints": [endpoint]},
    }


def _monitor_metadata(spec: KubernetesSpec, name: str, component: str) -> dict[str, object]:
    """A PodMonitor's metadata with ``kubernetes.monitor_labels``: the Prometheus Operator picks up only the
    PodMonitors its Prometheus selects (kube-prometheus-stack: ``release: <its Helm release>``)."""
    metadata = object_metadata(spec, name, component)
    metadata["labels"] = {**object_labels(spec, component), **spec.monitor_labels}
    return metadata


def dashboard_config_map(settings: Settings) -> dict[str, Any]:
    """The dashboard in a ConfigMap that Grafana's sidecar loads (label ``grafana_dashboard: "1"``)."""
    spec = settings.kubernetes
    metadata = object_metadata(spec, f"{spec.name}-grafana-dashboard", "dashboard")
    metadata["labels"] = {**object_labels(spec, "dashboard"), **GRAFANA_SIDECAR_LABEL}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {DASHBOARD_FILE: dashboard_json()}}
