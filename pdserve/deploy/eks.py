"""Pure: Settings -> the ordered steps of ``pdserve cloud up`` and ``cloud down`` on EKS.

Every step is safe to re-run: it carries a check that says it is already done (or that there is
nothing left to remove), or it is idempotent by itself. No I/O here: ``runner.py`` executes plans.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from pdserve.config import Settings
from pdserve.deploy.eksctl import GPU_NODE_GROUP, SYSTEM_NODE_GROUP, Zones, cluster_config
from pdserve.deploy.k8s import render_manifests, render_yaml
from pdserve.deploy.k8s_names import (
    GATEWAY_PORT_NAME,
    RAY_TOKEN_SECRET_KEY,
    gateway_service_name,
    ray_token_secret_name,
)
from pdserve.deploy.steps import Poll, Readiness, Step

KUBERAY_CHART_REPO = "https://ray-project.github.io/kuberay-helm/"
KUBERAY_RELEASE = "kuberay-operator"
KUBERAY_NAMESPACE = "kuberay-system"
EFA_PLUGIN = "aws-efa-k8s-device-plugin-daemonset"  # what eksctl installs for efaEnabled node groups
_EFA_PLUGIN_TOLERATIONS = json.dumps({"spec": {"template": {"spec": {"tolerations": [{"operator": "Exists"}]}}}})
_PODMONITOR_CRD = "podmonitors.monitoring.coreos.com"
_POD_MONITOR_KIND = "PodMonitor"


def kube_context(settings: Settings) -> str:
    """The kubeconfig context ``cloud up`` writes; every kubectl and helm call names it, so a
    different current context can never receive pdserve's objects (or their deletion)."""
    return f"pdserve-{settings.eks.cluster_name}-{settings.eks.region}"


def kubectl(settings: Settings, *args: str) -> tuple[str, ...]:
    return ("kubectl", "--context", kube_context(settings), *args)


def kubeconfig_argv(settings: Settings) -> tuple[str, ...]:
    """Writes (or refreshes) ``kube_context`` in the user's kubeconfig; idempotent."""
    eks = settings.eks
    return ("aws", "eks", "update-kubeconfig", "--name", eks.cluster_name, "--region", eks.region,
            "--alias", kube_context(settings))


def plan_up(settings: Settings, *, zones: Zones, ray_token: str) -> list[Step]:
    """Cluster, node groups, kubeconfig, KubeRay, namespace, Ray token, manifests, then a wait until
    the Serve app runs. ``ray_token`` is used only if the Secret does not exist yet, and never shown.
    Raises ConfigError (from the ClusterConfig) when the pools' node labels conflict."""
    cluster_yaml = yaml.safe_dump(cluster_config(settings, zones), sort_keys=False)
    return [
        *_cluster_steps(settings, cluster_yaml),
        *_operator_steps(settings),
        *_app_steps(settings, ray_token=ray_token),
    ]


def plan_down(settings: Settings) -> list[Step]:
    """``plan_up`` undone in reverse: the app's objects (while KubeRay can still finalize them),
    KubeRay, the cluster with its node groups, the kubeconfig context. What is already gone is
    skipped, so a re-run finishes an interrupted teardown."""
    eks, spec = settings.eks, settings.kubernetes
    context = kube_context(settings)
    secret = ray_token_secret_name(spec)
    cluster_exists = ("eksctl", "get", "cluster", "--name", eks.cluster_name, "--region", eks.region)
    delete = kubectl(settings, "delete", "-f", "-", "--ignore-not-found", "--wait=true")
    _, core_yaml, pod_monitor_yaml = _manifest_documents(settings)
    return [
        Step("kubeconfig", kubeconfig_argv(settings), only_if=cluster_exists),
        *_pod_monitor_steps(settings, delete, pod_monitor_yaml=pod_monitor_yaml),
        Step("manifests", delete, stdin=core_yaml,
             only_if=kubectl(settings, "get", "namespace", spec.namespace)),
        Step("ray-token", kubectl(settings, "delete", "secret", secret, "--namespace", spec.namespace,
                                  "--ignore-not-found"),
             only_if=kubectl(settings, "get", "secret", secret, "--namespace", spec.namespace)),
        Step("kuberay-operator", ("helm", "uninstall", KUBERAY_RELEASE, "--namespace", KUBERAY_NAMESPACE,
                                  "--kube-context", context, "--wait"),
             only_if=("helm", "status", KUBERAY_RELEASE, "--namespace", KUBERAY_NAMESPACE, "--kube-context", context)),
        Step("cluster", ("eksctl", "delete", "cluster", "--name", eks.cluster_name, "--region", eks.region, "--wait"),
             only_if=cluster_exists),
        Step("kube-context", ("kubectl", "config", "delete-context", context),
             only_if=("kubectl", "config", "get-contexts", context)),
    ]


def _cluster_steps(settings: Settings, cluster_yaml: str) -> list[Step]:
    """The control plane first, then each node group on its own, so an interrupted ``up`` resumes
    at the node group that is missing instead of skipping it with the cluster."""
    eks = settings.eks
    where = ("--region", eks.region)
    create = ("eksctl", "create", "nodegroup", "-f", "-", "--include")
    get = ("eksctl", "get", "nodegroup", "--cluster", eks.cluster_name, *where, "--name")
    return [
        Step("cluster", ("eksctl", "create", "cluster", "-f", "-", "--without-nodegroup"), stdin=cluster_yaml,
             done_check=("eksctl", "get", "cluster", "--name", eks.cluster_name, *where)),
        Step("system-nodes", (*create, SYSTEM_NODE_GROUP), stdin=cluster_yaml, done_check=(*get, SYSTEM_NODE_GROUP)),
        Step("gpu-nodes", (*create, GPU_NODE_GROUP), stdin=cluster_yaml, done_check=(*get, GPU_NODE_GROUP)),
        Step("kubeconfig", kubeconfig_argv(settings)),
        *_efa_plugin_steps(settings),
    ]


def _efa_plugin_steps(settings: Settings) -> list[Step]:
    """eksctl's EFA device plugin tolerates only its own taint: let it onto the tainted GPU nodes,
    or they never advertise ``vpc.amazonaws.com/efa``. A merge patch replaces the list: idempotent."""
    if not settings.eks.efa:
        return []
    plugin = ("--namespace", "kube-system", "daemonset", EFA_PLUGIN)
    patch = kubectl(settings, "patch", *plugin, "--type", "merge", "-p", _EFA_PLUGIN_TOLERATIONS)
    return [Step("efa-device-plugin", patch, only_if=kubectl(settings, "get", *plugin))]


def _operator_steps(settings: Settings) -> list[Step]:
    """KubeRay through its Helm chart, on the system nodes; ``upgrade --install`` is idempotent."""
    node_selector = json.dumps(settings.kubernetes.head_node_labels)
    return [
        Step("helm-repo", ("helm", "repo", "add", "kuberay", KUBERAY_CHART_REPO, "--force-update")),
        Step("kuberay-operator", (
            "helm", "upgrade", "--install", KUBERAY_RELEASE, "kuberay/kuberay-operator",
            "--version", settings.eks.kuberay_version, "--namespace", KUBERAY_NAMESPACE, "--create-namespace",
            "--kube-context", kube_context(settings), "--set-json", f"nodeSelector={node_selector}", "--wait")),
    ]


def _app_steps(settings: Settings, *, ray_token: str) -> list[Step]:
    """Namespace and token first (the pods mount the Secret), then the objects, then the wait."""
    spec = settings.kubernetes
    secret = ray_token_secret_name(spec)
    in_namespace = ("--namespace", spec.namespace)
    apply = kubectl(settings, "apply", "-f", "-")
    namespace_yaml, core_yaml, pod_monitor_yaml = _manifest_documents(settings)
    return [
        Step("namespace", apply, stdin=namespace_yaml),
        # the token goes through stdin: never in argv (ps), in the plan, or on the screen
        Step("ray-token", kubectl(settings, "create", "secret", "generic", secret, *in_namespace,
                                  f"--from-file={RAY_TOKEN_SECRET_KEY}=/dev/stdin"),
             done_check=kubectl(settings, "get", "secret", secret, *in_namespace),
             stdin=ray_token, is_stdin_secret=True),
        Step("manifests", apply, stdin=core_yaml),
        *_pod_monitor_steps(settings, apply, pod_monitor_yaml=pod_monitor_yaml),
        Step("serving", kubectl(settings, "get", "rayservice", spec.name, *in_namespace, "-o", "json"),
             poll=Poll(check=rayservice_readiness, timeout_s=settings.eks.ready_timeout_s)),
    ]


def _manifest_documents(settings: Settings) -> tuple[str, str, str]:
    """(Namespace, every other object but the PodMonitors, the PodMonitors or ''), as ``render k8s``
    writes them: the PodMonitors apply only where the Prometheus Operator's CRDs exist."""
    kinds = [obj["kind"] for obj in render_manifests(settings)]
    # documents start at column 0; a "---" inside serveConfigV2's block text is indented
    documents = list(zip(kinds, re.split(r"(?m)^---\n", render_yaml(settings)), strict=True))
    core = "---\n".join(text for kind, text in documents if kind != _POD_MONITOR_KIND)
    monitors = "---\n".join(text for kind, text in documents if kind == _POD_MONITOR_KIND)
    return next(text for kind, text in documents if kind == "Namespace"), core, monitors


def _pod_monitor_steps(settings: Settings, argv: tuple[str, ...], *, pod_monitor_yaml: str) -> list[Step]:
    """``argv`` (apply or delete) for the PodMonitors, if rendered, when their CRD is installed."""
    if not pod_monitor_yaml:
        return []
    return [Step("pod-monitor", argv, stdin=pod_monitor_yaml, only_if=kubectl(settings, "get", "crd", _PODMONITOR_CRD))]


def rayservice_readiness(rayservice_json: str) -> Readiness:
    """Ready when KubeRay says the RayService is Ready (its Ready condition, or ``serviceStatus:
    Running`` on older operators); the summary names each Serve app's and deployment's status."""
    status: dict[str, Any] = json.loads(rayservice_json).get("status") or {}
    conditions = {condition.get("type"): condition for condition in status.get("conditions") or []}
    ready = conditions.get("Ready", {})
    is_ready = ready.get("status") == "True" or status.get("serviceStatus") == "Running"
    apps = serve_app_states(status)
    summary = "; ".join(f"app {name} {state}" for name, state in apps.items()) or (
        ready.get("message") or ready.get("reason") or "no Serve application status yet")
    return Readiness(is_ready=is_ready, summary=summary)


def serve_app_states(rayservice_status: dict[str, Any]) -> dict[str, str]:
    """Serve app name -> "RUNNING (prefill HEALTHY, decode UPDATING, ...)" from a RayService's status."""
    active = rayservice_status.get("activeServiceStatus") or {}
    pending = rayservice_status.get("pendingServiceStatus") or {}
    applications: dict[str, Any] = active.get("applicationStatuses") or pending.get("applicationStatuses") or {}
    states = {}
    for name, app in applications.items():
        deployments = app.get("serveDeploymentStatuses") or {}
        parts = ", ".join(f"{deployment} {info.get('status', '?')}" for deployment, info in deployments.items())
        states[name] = f"{app.get('status', '?')}" + (f" ({parts})" if parts else "")
    return states


def reach_lines(settings: Settings) -> list[str]:
    """How to talk to the deployment from this machine once it serves."""
    spec, port = settings.kubernetes, settings.gateway.port
    forward = kubectl(settings, "port-forward", f"svc/{gateway_service_name(spec)}", "--namespace", spec.namespace,
                      f"{port}:{GATEWAY_PORT_NAME}")
    return [
        "reach it from this machine:",
        f"  {' '.join(forward)}",
        f"  curl http://127.0.0.1:{port}/v1/models",
        "check it: pdserve cloud status --config FILE; remove it: pdserve cloud down --config FILE",
    ]
