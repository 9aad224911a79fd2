"""Pure: Settings -> the ordered steps of ``pdserve cloud up`` and ``cloud down`` on EKS.

Every step is safe to re-run: it carries a check that says it is already done (or that there is
nothing left to remove), or it is idempotent by itself. No I/O here: ``runner.py`` executes plans.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from functools import partial

from pdserve.access import ADMIN_KEY_ENV, API_KEYS_ENV
from pdserve.cluster_config import EksSpec
from pdserve.config import Settings
from pdserve.deploy.aws_causes import cause_lines
from pdserve.deploy.eksctl import (
    GPU_NODE_GROUP,
    GPU_TAINT,
    INSUFFICIENT_CAPACITY,
    SYSTEM_NODE_GROUP,
    Zones,
    capacity_cause,
    cluster_config,
    node_group_failure_reads,
    node_group_state,
)
from pdserve.deploy.k8s import render_manifests, render_yaml, to_yaml
from pdserve.deploy.k8s_names import (
    API_KEYS_SECRET_KEYS,
    ENGINE_KEY_SECRET_KEY,
    GATEWAY_PORT_NAME,
    RAY_TOKEN_SECRET_KEY,
    api_keys_secret_name,
    engine_key_secret_name,
    gateway_service_name,
    ray_token_secret_name,
)
from pdserve.deploy.k8s_secrets import NewSecrets, read_back_command
from pdserve.deploy.pod_diagnosis import diagnose
from pdserve.deploy.preflight import (
    EFA_PLUGIN,
    IMAGE_CHECK_NAMESPACE,
    IMAGE_CHECK_POD,
    PLUGIN_NAMESPACE,
    efa_plugin_tolerations,
    gpu_nodes_query,
    gpu_nodes_readiness,
    gpu_nodes_wanted,
    image_check_pod,
    image_check_readiness,
)
from pdserve.deploy.rayservice import PODS_HASH_ANNOTATION
from pdserve.deploy.stacks import cluster_stack, failed_create, left_over, node_group_stack, stacks_query
from pdserve.deploy.steps import Fallback, Poll, Readiness, Step

KUBERAY_CHART_REPO = "https://ray-project.github.io/kuberay-helm/"
KUBERAY_RELEASE = "kuberay-operator"
# The engines and the device plugins come up in minutes once the nodes are Ready; a node that offers no
# GPU or EFA for this long after its plugin started will not.
GPU_NODES_TIMEOUT_S = 600.0
# Pulling the Ray LLM image (~10 GB) onto a system node takes minutes; a failed pull stops the wait at once.
IMAGE_CHECK_TIMEOUT_S = 1200.0
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


def plan_up(settings: Settings, *, zones: Zones, secrets: NewSecrets) -> list[Step]:
    """Cluster, node groups, kubeconfig, the preflight (GPU nodes, image), KubeRay, namespace, the Secrets
    (Ray token, engine key, gateway keys), manifests, then a wait until the Serve app runs. Each of ``secrets``
    is stored only where its Secret does not exist yet, and never shown. Raises ConfigError (from the
    ClusterConfig) when the pools' node labels conflict."""
    return [
        *_cluster_steps(settings, zones),
        *_preflight_steps(settings),
        *_operator_steps(settings),
        *_app_steps(settings, secrets=secrets),
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
        Step("kuberay-operator", ("helm", "uninstall", KUBERAY_RELEASE, "--namespace", spec.kuberay_namespace,
                                  "--kube-context", context, "--wait"),
             only_if=("helm", "status", KUBERAY_RELEASE, "--namespace", spec.kuberay_namespace, "--kube-context",
                      context)),
        # the stacks, not `eksctl get cluster`: a VPC stack left DELETE_FAILED outlives the EKS cluster
        Step("cluster", delete_cluster_argv(settings), only_if=stacks_query(eks), run_when=left_over,
             causes=partial(cause_lines, eks=eks)),
        Step("kube-context", ("kubectl", "config", "delete-context", context),
             only_if=("kubectl", "config", "get-contexts", context)),
    ]


def delete_cluster_argv(settings: Settings) -> tuple[str, ...]:
    """Removes the cluster and every stack of it, a rolled-back one included (eksctl pkg/ctl/delete/cluster.go:75-76)."""
    return ("eksctl", "delete", "cluster", "--name", settings.eks.cluster_name, "--region", settings.eks.region, "--wait")


def _cluster_steps(settings: Settings, zones: Zones) -> list[Step]:
    """The control plane first, then each node group on its own, so an interrupted ``up`` resumes
    at the node group that is missing instead of skipping it with the cluster. Each is preceded by the
    removal of a stack its failed create left, which would make eksctl fail or skip it."""
    eks = settings.eks
    where = ("--region", eks.region)
    cluster_yaml = to_yaml(cluster_config(settings, zones))
    causes = partial(cause_lines, eks=eks)
    create = ("eksctl", "create", "nodegroup", "-f", "-", "--include")
    nodes = {group: Step(f"{group}-nodes", (*create, group), stdin=cluster_yaml,
                         done_check=("eksctl", "get", "nodegroup", "--cluster", eks.cluster_name, *where, "--name", group,
                                     "--output", "json"),
                         done_when=partial(node_group_state, eks=eks, name=group), causes=causes,
                         check_output=partial(_skipped_group, group=group, stack=node_group_stack(eks, group),
                                              removal=" ".join(_delete_node_group_argv(settings, group))))
             for group in (SYSTEM_NODE_GROUP, GPU_NODE_GROUP)}
    return [
        _stack_clean_step("cluster-stack", cluster_stack(eks), delete_cluster_argv(settings), eks=eks),
        Step("cluster", ("eksctl", "create", "cluster", "-f", "-", "--without-nodegroup"), stdin=cluster_yaml,
             done_check=("eksctl", "get", "cluster", "--name", eks.cluster_name, *where), causes=causes),
        _stack_clean_step(f"{SYSTEM_NODE_GROUP}-stack", node_group_stack(eks, SYSTEM_NODE_GROUP),
                          _delete_node_group_argv(settings, SYSTEM_NODE_GROUP), eks=eks),
        nodes[SYSTEM_NODE_GROUP],
        _stack_clean_step(f"{GPU_NODE_GROUP}-stack", node_group_stack(eks, GPU_NODE_GROUP),
                          _delete_node_group_argv(settings, GPU_NODE_GROUP), eks=eks),
        replace(nodes[GPU_NODE_GROUP], fallback=_zone_fallback(settings, zones)),
        Step("kubeconfig", kubeconfig_argv(settings)),
        *_efa_plugin_steps(settings),
    ]


def _stack_clean_step(name: str, stack: str, removal: tuple[str, ...], *, eks: EksSpec) -> Step:
    """Removes ``stack`` when a failed create left it, after saying so; a listing that fails stops the plan."""
    return Step(name, removal, only_if=stacks_query(eks),
                run_when=partial(failed_create, stack=stack, removal=" ".join(removal)),
                about=f"removes {stack} if a failed create left it (ROLLBACK_COMPLETE, ROLLBACK_FAILED, CREATE_FAILED)")


def _delete_node_group_argv(settings: Settings, group: str) -> tuple[str, ...]:
    eks = settings.eks
    return ("eksctl", "delete", "nodegroup", "--cluster", eks.cluster_name, "--region", eks.region, "--name", group,
            "--wait")


# eksctl's line when a group of the config already has a stack (pkg/ctl/cmdutils/filter/nodegroup_filter.go:89-91)
_EXCLUDED = "existing nodegroup(s) ("


def _skipped_group(stdout: str, *, group: str, stack: str, removal: str) -> str:
    """eksctl exits 0 having created nothing when the group's stack exists: say which stack and how to remove it."""
    excluded = next((line for line in stdout.splitlines() if _EXCLUDED in line), "")
    if group not in excluded.partition(_EXCLUDED)[2].partition(")")[0].split(","):
        return ""
    return (f"eksctl created nothing: {excluded.strip()} (its stack {stack} exists). Remove it with `{removal}`, "
            "then run `pdserve cloud up` again")


def _zone_fallback(settings: Settings, zones: Zones) -> Fallback:
    """The GPU node group in each of its zones in turn, while EC2 has no capacity for it there. What a failed
    try leaves (a CREATE_FAILED group, or a rolled-back stack of that name that a new create would trip on) is
    removed with ``eksctl delete nodegroup``, as eksctl itself advises after a failed create."""
    eks = settings.eks
    tries = tuple((f"zone {zone}", to_yaml(cluster_config(settings, zones, gpu_zone=zone))) for zone in zones.gpu)
    # eksctl gives an EFA managed node group a cluster placement group of its own (eksctl
    # pkg/cfn/builder/managed_launch_template.go, NodeGroupPlacementGroup, strategy "cluster")
    placement = (" EFA node groups sit in a cluster placement group (eksctl), which needs all of them on "
                 "nearby hardware in one zone, so capacity is scarcer than for lone instances." if eks.efa else "")
    return Fallback(
        tries=tries,
        explain=node_group_failure_reads(eks, name=GPU_NODE_GROUP),
        cause=partial(capacity_cause, instance_type=eks.gpu_instance_type),
        undo=_delete_node_group_argv(settings, GPU_NODE_GROUP),
        about=f"{INSUFFICIENT_CAPACITY} (EC2 has no {eks.gpu_nodes} x {eks.gpu_instance_type} to spare in the zone)."
              + placement,
        fix=(f"List more zones in eks.availability_zones, try again later, ask AWS for capacity (an On-Demand "
             f"Capacity Reservation of {eks.gpu_instance_type}), or pick another eks.gpu_instance_type or eks.region."),
    )


def _efa_plugin_steps(settings: Settings) -> list[Step]:
    """eksctl's EFA device plugin tolerates only CriticalAddonsOnly and its own taint, and eksctl patches no
    more in (pkg/addons/device_plugin.go): let it onto the GPU nodes' taint, or they never offer
    ``vpc.amazonaws.com/efa``. A merge patch replaces the list: idempotent. A plugin that is missing fails
    the step: eksctl installs it with every efaEnabled node group."""
    if not settings.eks.efa:
        return []
    patch = {"spec": {"template": {"spec": {"tolerations": efa_plugin_tolerations()}}}}
    return [Step("efa-device-plugin", kubectl(settings, "patch", "--namespace", PLUGIN_NAMESPACE, "daemonset",
                                              EFA_PLUGIN, "--type", "merge", "-p", json.dumps(patch)),
                 about=f"lets eksctl's EFA device plugin onto the GPU nodes' {GPU_TAINT['key']} taint")]


def _preflight_steps(settings: Settings) -> list[Step]:
    """Before anything is applied: the GPU nodes offer what the engine pods request, and the image can be
    pulled and carries the Ray that ``kubernetes.ray_version`` names."""
    return [
        Step("gpu-nodes-ready", gpu_nodes_query(kubectl(settings)),
             poll=Poll(check=partial(gpu_nodes_readiness, settings=settings), timeout_s=GPU_NODES_TIMEOUT_S),
             about=f"preflight: {gpu_nodes_wanted(settings)}; stops at once if a device plugin can never run there"),
        *_image_check_steps(settings),
    ]


def _image_check_steps(settings: Settings) -> list[Step]:
    """The check pod: one an interrupted run left is removed first (a pod's spec cannot change, and its old
    pull errors would be read as new), then it is created, watched until it exits or its pull fails, removed."""
    pod = ("pod", IMAGE_CHECK_POD, "--namespace", IMAGE_CHECK_NAMESPACE)
    remove = kubectl(settings, "delete", *pod, "--ignore-not-found", "--wait=true")
    return [
        Step("image-check-clean", remove, only_if=kubectl(settings, "get", *pod),
             about="removes the image check pod an interrupted `cloud up` left"),
        Step("image-check-pod", kubectl(settings, "create", "-f", "-"), stdin=to_yaml(image_check_pod(settings))),
        Step("image-ray-version", kubectl(settings, "get", *pod, "-o", "json"),
             poll=Poll(check=partial(image_check_readiness, settings=settings), timeout_s=IMAGE_CHECK_TIMEOUT_S),
             about=f"preflight: the image's Ray is kubernetes.ray_version {settings.kubernetes.ray_version}; "
                   "stops at the first pull error the kubelet reports"),
        Step("image-check-done", remove),
    ]


def _operator_steps(settings: Settings) -> list[Step]:
    """KubeRay through its Helm chart, on the system nodes; ``upgrade --install`` is idempotent."""
    node_selector = json.dumps(settings.kubernetes.head_node_labels)
    return [
        Step("helm-repo", ("helm", "repo", "add", "kuberay", KUBERAY_CHART_REPO, "--force-update")),
        Step("kuberay-operator", (
            "helm", "upgrade", "--install", KUBERAY_RELEASE, "kuberay/kuberay-operator",
            "--version", settings.eks.kuberay_version, "--namespace", settings.kubernetes.kuberay_namespace,
            "--create-namespace",
            "--kube-context", kube_context(settings), "--set-json", f"nodeSelector={node_selector}", "--wait")),
    ]


def _app_steps(settings: Settings, *, secrets: NewSecrets) -> list[Step]:
    """Namespace and Secrets first (the pods require them), then the objects, then the wait."""
    spec = settings.kubernetes
    in_namespace = ("--namespace", spec.namespace)
    apply = kubectl(settings, "apply", "-f", "-")
    namespace_yaml, core_yaml, pod_monitor_yaml = _manifest_documents(settings)
    return [
        Step("namespace", apply, stdin=namespace_yaml),
        *_secret_steps(settings, secrets=secrets),
        *_replace_steps(settings),
        Step("manifests", apply, stdin=core_yaml),
        *_pod_monitor_steps(settings, apply, pod_monitor_yaml=pod_monitor_yaml),
        Step("serving", kubectl(settings, "get", "rayservices,pods,events,nodes", *in_namespace, "-o", "json"),
             poll=Poll(check=partial(diagnose, rayservice_name=spec.name),
                       timeout_s=settings.eks.ready_timeout_s)),
    ]


API_KEYS_STEP = "api-keys"


def _secret_steps(settings: Settings, *, secrets: NewSecrets) -> list[Step]:
    """Each Secret the pods require, made from ``secrets`` unless it exists. The values go through stdin: never
    in argv (ps), in the plan, or on the screen (``kubectl create secret generic --from-file``/``--from-env-file``
    read /dev/stdin: kubectl create_secret.go, handleSecretFromEnvFileSources)."""
    spec = settings.kubernetes
    sources = [
        ("ray-token", ray_token_secret_name(spec), f"--from-file={RAY_TOKEN_SECRET_KEY}=/dev/stdin", secrets.ray_token),
        ("engine-key", engine_key_secret_name(spec), f"--from-file={ENGINE_KEY_SECRET_KEY}=/dev/stdin",
         secrets.engine_key),
    ]
    if not settings.access.open:
        sources.append((API_KEYS_STEP, api_keys_secret_name(spec), "--from-env-file=/dev/stdin",
                        secrets.api_keys_env_file()))
    in_namespace = ("--namespace", spec.namespace)
    return [Step(step, kubectl(settings, "create", "secret", "generic", name, *in_namespace, source),
                 done_check=kubectl(settings, "get", "secret", name, *in_namespace), stdin=value, is_stdin_secret=True)
            for step, name, source, value in sources]


def _replace_steps(settings: Settings) -> list[Step]:
    """With ``kubernetes.upgrade: recreate`` (KubeRay's upgradeStrategy None) KubeRay ignores changes to the
    pods, so a RayService whose pods changed is deleted first and created anew by the next step."""
    spec = settings.kubernetes
    if spec.upgrade != "recreate":
        return []
    rendered = next(obj for obj in render_manifests(settings) if obj["kind"] == "RayService")
    current = rendered["metadata"]["annotations"][PODS_HASH_ANNOTATION]
    return [Step("replace-pods", kubectl(settings, "delete", "rayservice", spec.name, "--namespace", spec.namespace,
                                         "--ignore-not-found", "--wait=true"),
                 done_check=kubectl(settings, "get", "rayservices", "--namespace", spec.namespace, "-o", "json"),
                 done_when=partial(_pods_unchanged, name=spec.name, current=current))]


def _pods_unchanged(list_json: str, *, name: str, current: str) -> Readiness:
    """Nothing to replace when the RayService is absent or was rendered with the same pods."""
    for item in json.loads(list_json).get("items", []):
        if item["metadata"]["name"] == name:
            live = (item["metadata"].get("annotations") or {}).get(PODS_HASH_ANNOTATION, "")
            return Readiness(is_ready=live == current, summary=f"pods {live or 'unknown'} -> {current}")
    return Readiness(is_ready=True, summary="no RayService yet")


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


def reach_lines(settings: Settings) -> list[str]:
    """How to talk to the deployment from this machine once it serves."""
    spec, port = settings.kubernetes, settings.gateway.port
    forward = kubectl(settings, "port-forward", f"svc/{gateway_service_name(spec)}", "--namespace", spec.namespace,
                      f"{port}:{GATEWAY_PORT_NAME}")
    return [
        "reach it from this machine:",
        f"  {' '.join(forward)}",
        f"  curl{_authorization(settings)} http://127.0.0.1:{port}/v1/models",
        *_admin_key_lines(settings),
        "check it: pdserve cloud status --config FILE; remove it: pdserve cloud down --config FILE",
    ]


def _authorization(settings: Settings) -> str:
    """curl's option that sends the API key `cloud up` stored, read back from its Secret ('' with access.open)."""
    if settings.access.open:
        return ""
    return f' -H "Authorization: Bearer $({_read_back(settings, API_KEYS_ENV)})"'


def _admin_key_lines(settings: Settings) -> list[str]:
    """`cloud status` reads the gateway's engines and metrics with the admin key, from PDSERVE_ADMIN_KEY."""
    if settings.access.open:
        return []
    return ["for `pdserve cloud status`, the admin key:", f"  export {ADMIN_KEY_ENV}=$({_read_back(settings, ADMIN_KEY_ENV)})"]


def _read_back(settings: Settings, variable: str) -> str:
    """The command that prints the key the gateway reads as ``variable`` from its Secret."""
    spec = settings.kubernetes
    return read_back_command(spec, secret=api_keys_secret_name(spec), key=API_KEYS_SECRET_KEYS[variable],
                             kubectl=" ".join(kubectl(settings)))
