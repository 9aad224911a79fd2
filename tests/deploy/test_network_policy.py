"""The NetworkPolicies `render k8s` writes: valid against the Kubernetes API schema, and letting in exactly the
flows docs/deploy.md lists ("Network policies"), no more, no fewer; the ports they open are the ports the pods
are told to listen on."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from pdserve.config import Settings
from pdserve.deploy.k8s import kubernetes_settings, render_manifests
from tests.deploy.test_k8s import CONFIGS, container, eks, ray_groups, rayservice_of

DEPLOY_DOC = Path(__file__).parents[2] / "docs" / "deploy.md"


def components(*names: str) -> dict[str, Any]:
    return {"matchLabels": {"app.kubernetes.io/instance": "pdserve"},
            "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In", "values": list(names)}]}


def outside(namespace: str, app: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": app}}}


# The doc's words for the pods a policy selects and the peers it admits, as label selectors.
SELECTS = {
    "every pod of the namespace": {},
    "gateway pods": {"matchLabels": {"app.kubernetes.io/instance": "pdserve", "pdserve.io/gateway": "true"}},
    "head": components("head"),
    "Ray pods": components("head", "gateway", "prefill", "decode"),
    "prefill pods": components("prefill"),
    "decode pods": components("decode"),
    "engine pods": components("prefill", "decode"),
}
PEERS = {
    **{name: {"podSelector": selector} for name, selector in SELECTS.items() if name != "every pod of the namespace"},
    "KubeRay operator": outside("kuberay-system", "kuberay-operator"),
    "Prometheus": outside("monitoring", "prometheus"),
}
Flow = tuple[str, str, str, str]  # policy, the pods it selects, a peer ("anyone", "nobody"), a TCP port or range


def doc_rows() -> list[dict[str, str]]:
    """The rows of the table under "### Network policies", by column header."""
    section = DEPLOY_DOC.read_text().split("### Network policies\n", 1)[1].split("\n### ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True)) for line in lines[2:]]


def doc_flows(settings: Settings) -> set[Flow]:
    """Each (policy, selects, peer, port) the doc lists for ``settings``: a row marked UCX only where UCX carries
    the KV as the cluster runs it."""
    backends = kubernetes_settings(settings).kv.backends
    flows: set[Flow] = set()
    for row in doc_rows():
        if row["when"] == "UCX" and "UCX" not in backends:
            continue
        policy = row["policy"].strip("`").replace("<name>", "pdserve")
        ports = re.findall(r"`(\d+(?:-\d+)?)`", row["TCP ports"]) or [""]
        flows |= {(policy, row["selects"], peer, port) for peer in row["from"].split(", ") for port in ports}
    return flows


def name_of(selector: dict[str, Any], names: dict[str, dict[str, Any]]) -> str:
    (name,) = [name for name, known in names.items() if known == selector] or [f"unknown {selector}"]
    return name


def rendered_flows(policies: list[dict[str, Any]]) -> set[Flow]:
    """The same tuples, read back from the rendered policies: every peer of every rule on every port of it."""
    flows: set[Flow] = set()
    for policy in policies:
        name, spec = policy["metadata"]["name"], policy["spec"]
        selects = name_of(spec["podSelector"], SELECTS)
        if not spec["ingress"]:
            flows.add((name, selects, "nobody", ""))
        for rule in spec["ingress"]:
            peers = [name_of(peer, PEERS) for peer in rule["from"]] if "from" in rule else ["anyone"]
            ports = [f"{port['port']}-{port['endPort']}" if "endPort" in port else str(port["port"])
                     for port in rule["ports"]]
            flows |= {(name, selects, peer, port) for peer in peers for port in ports}
    return flows


def policies_of(settings: Settings) -> list[dict[str, Any]]:
    return [obj for obj in render_manifests(settings) if obj["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_the_policies_allow_exactly_the_flows_the_doc_lists(config: str) -> None:
    settings = CONFIGS[config]()
    assert rendered_flows(policies_of(settings)) == doc_flows(settings)


def test_the_kv_policy_opens_ucx_only_where_ucx_carries_the_kv() -> None:
    """EFA moves the KV outside IP: the example opens the side channels only; the defaults (UCX) also UCX's range."""
    assert {flow[3] for flow in rendered_flows(policies_of(eks())) if flow[0] == "pdserve-kv"} == {"5600", "5601"}
    defaults = {flow[3] for flow in rendered_flows(policies_of(CONFIGS["defaults"]())) if flow[0] == "pdserve-kv"}
    assert defaults == {"5600", "5601", "20000-20099"}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_each_policy_validates_against_the_kubernetes_schema(config: str) -> None:
    policies = policies_of(CONFIGS[config]())
    assert [policy["metadata"]["name"] for policy in policies] == [
        f"pdserve-{name}" for name in ("default-deny", "gateway", "head", "ray", "prefill", "decode", "kv")]
    for policy in policies:
        kubernetes_validate.validate(policy, eks().eks.kubernetes_version + ".0", strict=True)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_namespace_and_policies_come_before_any_pod(config: str) -> None:
    kinds = [obj["kind"] for obj in render_manifests(CONFIGS[config]())]
    assert kinds[0] == "Namespace" and kinds.index("RayService") == 1 + kinds.count("NetworkPolicy")
    (deny,) = [policy for policy in policies_of(CONFIGS[config]()) if policy["spec"]["podSelector"] == {}]
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": []}


def env_value(group: dict[str, Any], name: str) -> str | None:
    values = [var.get("value") for var in container(group)["env"] if var["name"] == name]
    return values[0] if values else None


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_the_ports_let_in_are_the_ports_the_pods_listen_on(config: str) -> None:
    """Ray's ports are pinned in every group's rayStartParams, UCX's range in the engines' UCX_TCP_PORT_RANGE (UCX
    uct/tcp/tcp_iface.c listens on a random port of it), the engines' API on their container port `vllm`."""
    settings = CONFIGS[config]()
    flows = rendered_flows(policies_of(settings))
    groups = ray_groups(rayservice_of(render_manifests(settings)))
    for group in groups.values():
        params = group["rayStartParams"]
        ray_ports = {params["node-manager-port"], params["object-manager-port"], params["dashboard-agent-grpc-port"],
                     f"{params['min-worker-port']}-{params['max-worker-port']}"}
        assert ray_ports <= {flow[3] for flow in flows if flow[0] == "pdserve-ray"}
    for role in ("prefill", "decode"):
        (port,) = container(groups[role])["ports"]
        assert (f"pdserve-{role}", f"{role} pods", "gateway pods", str(port["containerPort"])) in flows
        ucx = env_value(groups[role], "UCX_TCP_PORT_RANGE")
        kv_ports = {flow[3] for flow in flows if flow[0] == "pdserve-kv"}
        assert (ucx in kv_ports) if ucx else not any("-" in port for port in kv_ports)
    head_ports = {port["name"]: str(port["containerPort"]) for port in container(groups["head"])["ports"]}
    assert ("pdserve-gateway", "gateway pods", "anyone", head_ports["openai"]) in flows
    assert ("pdserve-head", "head", "KubeRay operator", head_ports["dashboard"]) in flows
