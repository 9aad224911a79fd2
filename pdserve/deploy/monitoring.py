"""Pure: cluster-ready Settings -> the objects that watch a deployment: PodMonitors for the
Prometheus Operator (the gateway's and the engines' /metrics, each scraped with the key it requires)
and the Grafana dashboard as a ConfigMap for Grafana's dashboard sidecar. Reads the packaged dashboard
JSON; writes nothing.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from pdserve.access import ADMIN_KEY_ENV
from pdserve.cluster_config import KubernetesSpec
from pdserve.config import Settings
from pdserve.deploy.k8s_names import (
    API_KEYS_SECRET_KEYS,
    ENGINE_KEY_SECRET_KEY,
    ENGINE_PORT_NAME,
    GATEWAY_PORT_NAME,
    api_keys_secret_name,
    engine_key_secret_name,
    engine_selector,
    gateway_selector,
    object_labels,
    object_metadata,
)

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
    """Tells the Prometheus Operator to scrape the gateway's /metrics on the head pod, with the admin key
    the gateway asks for there (none with ``access.open``, where the Secret may not exist)."""
    spec = settings.kubernetes
    endpoint: dict[str, Any] = {"port": GATEWAY_PORT_NAME, "path": "/metrics", "interval": METRICS_INTERVAL}
    if not settings.access.open:
        endpoint["authorization"] = bearer(api_keys_secret_name(spec), key=API_KEYS_SECRET_KEYS[ADMIN_KEY_ENV])
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _monitor_metadata(spec, f"{spec.name}-gateway", "gateway"),
        "spec": {"selector": {"matchLabels": gateway_selector(spec)}, "podMetricsEndpoints": [endpoint]},
    }


def engine_pod_monitor(settings: Settings) -> dict[str, Any]:
    """Tells the Prometheus Operator to scrape every engine's own vLLM /metrics on the worker pods, with the
    engine key every engine route but /health requires, and the pod's pool as a ``role`` label (prefill or decode)."""
    spec = settings.kubernetes
    role_label = {"sourceLabels": [POD_ROLE_LABEL], "targetLabel": "role", "action": "replace"}
    endpoint = {"port": ENGINE_PORT_NAME, "path": "/metrics", "interval": METRICS_INTERVAL,
                "authorization": bearer(engine_key_secret_name(spec), key=ENGINE_KEY_SECRET_KEY),
                "relabelings": [role_label]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _monitor_metadata(spec, f"{spec.name}-engines", "engines"),
        "spec": {"selector": engine_selector(spec), "podMetricsEndpoints": [endpoint]},
    }


def bearer(secret: str, *, key: str) -> dict[str, Any]:
    """A PodMetricsEndpoint's ``authorization``: ``Authorization: Bearer <key of Secret secret>``. The Secret must be
    in the PodMonitor's namespace (prometheus-operator example/prometheus-operator-crd/
    monitoring.coreos.com_podmonitors.yaml, podMetricsEndpoints[].authorization: type, default Bearer; credentials,
    a SecretKeySelector)."""
    return {"type": "Bearer", "credentials": {"name": secret, "key": key}}


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
