"""The Prometheus Operator and Grafana objects `render k8s` writes: they find the pods and ports the
RayService makes, and carry the dashboard as shipped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdserve.config import Settings, load_settings
from pdserve.deploy.k8s import render_manifests
from pdserve.deploy.monitoring import dashboard_json
from pdserve.role import Role
from tests.deploy.test_k8s import CONFIGS, container, eks, pruned_fields, ray_groups

MONITORING_API = "monitoring.coreos.com/v1"
# The Prometheus Operator's PodMonitor CRD, vendored with its commit in the file's first lines.
POD_MONITOR_CRD = Path(__file__).parent / "schemas" / "monitoring.coreos.com_podmonitors.yaml"


@pytest.fixture(params=sorted(CONFIGS))
def objects(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """Every rendered object by ``kind/name``."""
    settings: Settings = CONFIGS[request.param]()
    return {f"{obj['kind']}/{obj['metadata']['name']}": obj for obj in render_manifests(settings)}


def is_selected(labels: dict[str, str], selector: dict[str, Any]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions with In) applied to ``labels``."""
    if not selector["matchLabels"].items() <= labels.items():
        return False
    return all(labels.get(rule["key"]) in rule["values"] for rule in selector.get("matchExpressions", []))


def test_engine_pod_monitor_scrapes_the_vllm_port_of_every_worker_pod_and_no_head(
    objects: dict[str, dict[str, Any]],
) -> None:
    monitor = objects["PodMonitor/pdserve-engines"]
    assert (monitor["apiVersion"], monitor["metadata"]["namespace"]) == (MONITORING_API, "pdserve")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("vllm", "/metrics")
    groups = ray_groups(objects["RayService/pdserve"])
    for role in ("prefill", "decode"):
        assert is_selected(groups[role]["template"]["metadata"]["labels"], monitor["spec"]["selector"])
        assert [port["name"] for port in container(groups[role])["ports"]] == ["vllm"]
    assert not is_selected(groups["head"]["template"]["metadata"]["labels"], monitor["spec"]["selector"])


def test_engine_series_carry_their_pool_as_role(objects: dict[str, dict[str, Any]]) -> None:
    (endpoint,) = objects["PodMonitor/pdserve-engines"]["spec"]["podMetricsEndpoints"]
    (relabel,) = endpoint["relabelings"]
    assert relabel == {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
                       "targetLabel": "role", "action": "replace"}


def test_worker_pods_name_the_port_their_engine_binds() -> None:
    """One engine per pod binds its pool's base_port (ray/engine_replica.py)."""
    settings = eks()
    groups = ray_groups(next(obj for obj in render_manifests(settings) if obj["kind"] == "RayService"))
    for role in Role:
        (port,) = container(groups[role.value])["ports"]
        assert port["containerPort"] == settings.pool(role).base_port


def test_dashboard_config_map_carries_the_dashboard_for_grafanas_sidecar(objects: dict[str, dict[str, Any]]) -> None:
    config_map = objects["ConfigMap/pdserve-grafana-dashboard"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "pdserve"
    (name,) = config_map["data"]
    assert name.endswith(".json") and json.loads(config_map["data"][name]) == json.loads(dashboard_json())
    kubernetes_validate.validate(config_map, eks().eks.kubernetes_version + ".0", strict=True)


def test_dashboard_alone_can_be_turned_off() -> None:
    settings = load_settings(None, overrides={"gateway.port": 9000, "kubernetes.grafana_dashboard": False})
    kinds = [obj["kind"] for obj in render_manifests(settings)]
    assert kinds == ["Namespace", *["NetworkPolicy"] * 7, "RayService", "Service", "PodMonitor", "PodMonitor"]


def test_pod_monitors_carry_the_label_a_default_kube_prometheus_stack_selects_on(
    objects: dict[str, dict[str, Any]],
) -> None:
    """kube-prometheus-stack's Prometheus selects PodMonitors labelled with its Helm release by default."""
    for name in ("PodMonitor/pdserve-gateway", "PodMonitor/pdserve-engines"):
        assert objects[name]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    mine = load_settings(None, overrides={"gateway.port": 9000, "kubernetes.monitor_labels": {"release": "monitoring"}})
    monitors = [obj for obj in render_manifests(mine) if obj["kind"] == "PodMonitor"]
    assert [monitor["metadata"]["labels"]["release"] for monitor in monitors] == ["monitoring", "monitoring"]


def pod_monitor_schema() -> dict[str, Any]:
    crd = yaml.safe_load(POD_MONITOR_CRD.read_text())
    (v1,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    schema: dict[str, Any] = v1["schema"]["openAPIV3Schema"]
    return schema


def test_each_pod_monitor_scrapes_with_the_key_its_metrics_require(objects: dict[str, dict[str, Any]]) -> None:
    """With keys on, the gateway's /metrics answers the admin key only, an engine's the engine key only; the
    Prometheus Operator reads each from a Secret of the PodMonitor's namespace, as its CRD's schema has it."""
    schema = pod_monitor_schema()
    for name in ("PodMonitor/pdserve-gateway", "PodMonitor/pdserve-engines"):
        jsonschema.validate(objects[name], schema, cls=jsonschema.Draft7Validator)
        assert pruned_fields(objects[name], schema) == [], name  # nothing the API server would silently drop
    (gateway,) = objects["PodMonitor/pdserve-gateway"]["spec"]["podMetricsEndpoints"]
    (engines,) = objects["PodMonitor/pdserve-engines"]["spec"]["podMetricsEndpoints"]
    assert gateway["authorization"] == {"type": "Bearer", "credentials": {"name": "pdserve-api-keys", "key": "admin_key"}}
    assert engines["authorization"] == {"type": "Bearer",
                                        "credentials": {"name": "pdserve-engine-key", "key": "engine_key"}}
    secrets = {"Secret/" + ref["secretKeyRef"]["name"] + "/" + ref["secretKeyRef"]["key"]
               for group in ray_groups(objects["RayService/pdserve"]).values()
               for ref in (var.get("valueFrom", {}) for var in container(group)["env"]) if "secretKeyRef" in ref}
    for endpoint in (gateway, engines):  # the very keys the pods are given
        credentials = endpoint["authorization"]["credentials"]
        assert f"Secret/{credentials['name']}/{credentials['key']}" in secrets
