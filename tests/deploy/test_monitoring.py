"""The Prometheus Operator and Grafana objects `render k8s` writes: they find the pods and ports the
RayService makes, and carry the dashboard as shipped."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from pdserve.config import Settings, load_settings
from pdserve.deploy.k8s import render_manifests
from pdserve.deploy.monitoring import dashboard_json
from pdserve.role import Role
from tests.deploy.test_k8s import CONFIGS, container, eks, ray_groups

MONITORING_API = "monitoring.coreos.com/v1"


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
    assert kinds == ["Namespace", "RayService", "Service", "PodMonitor", "PodMonitor"]


def test_pod_monitors_carry_the_label_a_default_kube_prometheus_stack_selects_on(
    objects: dict[str, dict[str, Any]],
) -> None:
    """kube-prometheus-stack's Prometheus selects PodMonitors labelled with its Helm release by default."""
    for name in ("PodMonitor/pdserve-gateway", "PodMonitor/pdserve-engines"):
        assert objects[name]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    mine = load_settings(None, overrides={"gateway.port": 9000, "kubernetes.monitor_labels": {"release": "monitoring"}})
    monitors = [obj for obj in render_manifests(mine) if obj["kind"] == "PodMonitor"]
    assert [monitor["metadata"]["labels"]["release"] for monitor in monitors] == ["monitoring", "monitoring"]
