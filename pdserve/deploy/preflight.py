"""Pure: the checks ``cloud up`` makes before it applies anything, and the commands that read what they need.

- The GPU nodes: each offers ``nvidia.com/gpu`` and the EFA interfaces the pools ask for, and the EFA
  device plugin runs on it. A plugin that can never run there (its tolerations or node affinity leave the
  node out) stops ``cloud up`` at once with the fix; one that is still starting is waited for.
- The image: a throw-away pod of it on a system node pulls it and writes its Ray version where the pod's status
  carries it back; a pull the kubelet reports failed (no such image, a registry that refuses the node, a name it
  cannot parse) stops ``cloud up`` at the first look (one cut on the way, a reset or throttling, is waited out),
  with the kubelet's own reason and message. Its Ray must be
  ``kubernetes.ray_version``.

No I/O: ``eks.py`` puts the commands in the plan, ``runner.py`` runs them and hands their output here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdserve.config import Settings
from pdserve.deploy.eksctl import GPU_NODE_GROUP, GPU_TAINT
from pdserve.deploy.pod_diagnosis import TRANSIENT_TAINTS, container_problem
from pdserve.deploy.pod_security import container_security, home_env, pod_security, writable_mount, writable_volume
from pdserve.deploy.rayservice import EFA_RESOURCE, GPU_RESOURCE
from pdserve.deploy.steps import Readiness
from pdserve.role import Role

# eksctl's EFA device plugin for efaEnabled node groups (eksctl pkg/addons/assets/efa-device-plugin.yaml).
EFA_PLUGIN = "aws-efa-k8s-device-plugin"
EFA_PLUGIN_LABEL = {"name": EFA_PLUGIN}
PLUGIN_NAMESPACE = "kube-system"
# EKS labels every node of a managed node group with the group's name.
NODE_GROUP_LABEL = "eks.amazonaws.com/nodegroup"
IMAGE_CHECK_POD = "pdserve-image-check"
IMAGE_CHECK_NAMESPACE = "default"
# The kubelet copies this file's content into the container's terminated state (status.containerStatuses[].state
# .terminated.message) when it exits; FallbackToLogsOnError puts the log's tail there instead when the file is empty
# and the exit is an error, so a traceback comes back the same way (kubernetes.io/docs/tasks/debug/debug-application/
# determine-reason-pod-failure/, "Customizing the termination message"). The kubelet makes the file writable for a
# non-root user such as the Ray images' (pkg/kubelet/kuberuntime/kuberuntime_container.go, makeMounts).
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
_WRITE_RAY_VERSION = f"import ray; open({TERMINATION_MESSAGE_PATH!r}, 'w').write(ray.__version__)"
_VERSION = re.compile(r"^\d+\.\d+\.\d+\S*$")
_BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
# The DaemonSet controller adds these tolerations to every pod it creates, on top of the template
# (kubernetes pkg/controller/daemon/util/daemonset_util.go, AddOrUpdateDaemonPodTolerations), and decides
# where a pod may run with them (daemon_controller.go NewPod, predicates): not-ready and unreachable with
# NoExecute; disk-pressure, memory-pressure, pid-pressure and unschedulable with NoSchedule; network-unavailable
# with NoSchedule for a hostNetwork pod only. node.kubernetes.io/not-ready:NoSchedule is not among them.
DAEMON_POD_TOLERATIONS = (
    *({"key": f"node.kubernetes.io/{key}", "operator": "Exists", "effect": "NoExecute"}
      for key in ("not-ready", "unreachable")),
    *({"key": f"node.kubernetes.io/{key}", "operator": "Exists", "effect": "NoSchedule"}
      for key in ("disk-pressure", "memory-pressure", "pid-pressure", "unschedulable")),
)
HOST_NETWORK_TOLERATION = {"key": "node.kubernetes.io/network-unavailable", "operator": "Exists", "effect": "NoSchedule"}
_NO_EFA = (f"so it never runs there, the node offers no {EFA_RESOURCE} and the engine pods would stay Pending "
           f"(FailedScheduling: Insufficient {EFA_RESOURCE})")


def gpu_nodes_query(kubectl: tuple[str, ...]) -> tuple[str, ...]:
    """One read of the nodes, and of the device plugins' DaemonSets and pods."""
    return (*kubectl, "get", "nodes,daemonsets,pods", "--namespace", PLUGIN_NAMESPACE, "-o", "json")


def efa_plugin_tolerations() -> list[dict[str, str]]:
    """eksctl's own two tolerations and the GPU nodes' taint: the whole list, so a merge patch is idempotent."""
    return [{"key": "CriticalAddonsOnly", "operator": "Exists"},
            {"key": "aws.amazon.com/efa", "operator": "Exists", "effect": "NoSchedule"},
            {"key": GPU_TAINT["key"], "operator": "Exists", "effect": GPU_TAINT["effect"]}]


def gpu_nodes_readiness(list_json: str, *, settings: Settings) -> Readiness:
    """Ready when every GPU node offers what the engine pods request; a blocker when one never will."""
    items: list[dict[str, Any]] = json.loads(list_json).get("items", [])
    nodes = [item for item in items if item.get("kind") == "Node"
             and _labels(item).get(NODE_GROUP_LABEL) == GPU_NODE_GROUP]
    if len(nodes) < settings.eks.gpu_nodes:
        return Readiness(is_ready=False, summary=f"{len(nodes)}/{settings.eks.gpu_nodes} GPU nodes registered")
    gpus, efa = _per_pod(settings)
    waiting: list[str] = []
    blockers: list[str] = []
    if efa:
        plugin = next((item for item in items if item.get("kind") == "DaemonSet"
                       and item["metadata"]["name"] == EFA_PLUGIN), None)
        if plugin is None:
            blockers.append(f"no DaemonSet {EFA_PLUGIN} in {PLUGIN_NAMESPACE}: eksctl installs it with an efaEnabled "
                            "node group (eks.efa); create the node group again with eks.efa: true")
        else:
            plugin_pods = [item for item in items if item.get("kind") == "Pod"
                           and EFA_PLUGIN_LABEL.items() <= _labels(item).items()]
            for node in nodes:
                blockers += _plugin_blockers(plugin, node)
                waiting += _plugin_waits(plugin_pods, node)
    for node in nodes:
        waiting += _node_waits(node) + _capacity_waits(node, gpus=gpus, efa=efa)
    blockers += _missing_nvidia_plugin(items, nodes, gpus=gpus)
    summary = "; ".join(waiting) or f"{len(nodes)} GPU nodes, each with {gpus} {GPU_RESOURCE}" + (
        f" and {efa} {EFA_RESOURCE}, the EFA device plugin running on each" if efa else "")
    return Readiness(is_ready=not waiting and not blockers, summary=summary, blocker="\n".join(blockers))


# eksctl's NVIDIA device plugin for GPU node groups (eksctl pkg/addons/assets/nvidia-device-plugin.yaml:18-19);
# other installers (the GPU operator) name theirs alike
NVIDIA_PLUGIN = "nvidia-device-plugin"


def _missing_nvidia_plugin(items: list[dict[str, Any]], nodes: list[dict[str, Any]], *, gpus: int) -> list[str]:
    """Without a DaemonSet of the NVIDIA device plugin, no node ever offers nvidia.com/gpu: no use waiting."""
    short = [node["metadata"]["name"] for node in nodes
             if int(((node.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, "0")) < gpus]
    plugins = [item for item in items if item.get("kind") == "DaemonSet" and NVIDIA_PLUGIN in item["metadata"]["name"]]
    if not gpus or not short or plugins:
        return []
    return [(f"no NVIDIA device plugin DaemonSet in {PLUGIN_NAMESPACE}, so {', '.join(short)} will never offer "
             f"{GPU_RESOURCE}. eksctl installs it with a GPU node group unless told not to (installNvidiaDevicePlugin: "
             "false): install NVIDIA's device plugin (github.com/NVIDIA/k8s-device-plugin, tolerating the GPU nodes' "
             f"{GPU_TAINT['key']} taint), then run `pdserve cloud up` again")]


def gpu_nodes_wanted(settings: Settings) -> str:
    """What the GPU-node check waits for, in words."""
    gpus, efa = _per_pod(settings)
    wanted = f"each of the {settings.eks.gpu_nodes} GPU nodes offers {gpus} {GPU_RESOURCE}"
    return wanted + (f" and {efa} {EFA_RESOURCE} and runs the EFA device plugin {EFA_PLUGIN}" if efa else "")


def image_check_pod(settings: Settings) -> dict[str, Any]:
    """A throw-away pod of the image on a system node, where the Ray head will run (so the pull is not wasted),
    that writes its Ray version to its termination message and exits. Created, polled, then removed."""
    container = {"name": "check", "image": settings.kubernetes.image, "command": ["python", "-c", _WRITE_RAY_VERSION],
                 "terminationMessagePath": TERMINATION_MESSAGE_PATH, "terminationMessagePolicy": "FallbackToLogsOnError",
                 "env": home_env(), "securityContext": container_security(), "volumeMounts": [writable_mount()]}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": IMAGE_CHECK_POD, "namespace": IMAGE_CHECK_NAMESPACE,
                         "labels": {"app.kubernetes.io/name": IMAGE_CHECK_POD}},
            "spec": {**pod_security(), "restartPolicy": "Never",
                     "nodeSelector": dict(settings.kubernetes.head_node_labels), "containers": [container],
                     "volumes": [writable_volume()]}}


def image_check_readiness(pod_json: str, *, settings: Settings) -> Readiness:
    """One look at the check pod (``kubectl get pod -o json``): ready when it exited 0 having written
    ``kubernetes.ray_version``; a blocker at the first pull failure the kubelet reports, when the check
    exited non-zero, or when the image carries another Ray; else it is still being pulled or run."""
    pod: dict[str, Any] = json.loads(pod_json)
    status = pod.get("status") or {}
    problem = container_problem(pod)
    if problem is not None and problem.fix:
        return Readiness(is_ready=False, summary=problem.cause, blocker=(
            f"the image {settings.kubernetes.image} cannot be pulled: {problem.cause}\n    fix: {problem.fix}; "
            f"`kubectl --namespace {IMAGE_CHECK_NAMESPACE} describe pod {IMAGE_CHECK_POD}` shows the kubelet's events "
            "(the next `pdserve cloud up` replaces the pod)"))
    if problem is not None:  # a pull cut on the way (pod_diagnosis.TRANSIENT_PULL_MARKS): the kubelet tries again
        return Readiness(is_ready=False, summary=f"{problem.cause} (transient: the kubelet pulls again)")
    states = [container.get("state") or {} for container in status.get("containerStatuses") or []]
    terminated = next((state["terminated"] for state in states if state.get("terminated")), None)
    if terminated is None:
        waiting = [(state.get("waiting") or {}).get("reason", "") for state in states]
        return Readiness(is_ready=False, summary=", ".join(filter(None, waiting)) or status.get("phase", "Pending"))
    message = str(terminated.get("message", ""))
    if terminated.get("exitCode") != 0:
        return Readiness(is_ready=False, summary=f"exit {terminated.get('exitCode')}", blocker=(
            f"the image {settings.kubernetes.image} could not run `python -c {_WRITE_RAY_VERSION!r}`: exit "
            f"{terminated.get('exitCode')} ({terminated.get('reason', '')}): {message.strip()[-500:]}"))
    problem_text = ray_version_problem(message, settings=settings)
    return Readiness(is_ready=not problem_text, summary=f"the image carries Ray {message.strip()}", blocker=problem_text)


def ray_version_problem(output: str, *, settings: Settings) -> str:
    """'' when the image's Ray (the last version-like line of the check pod's message) is ``kubernetes.ray_version``."""
    spec = settings.kubernetes
    found = next((line.strip() for line in reversed(output.splitlines()) if _VERSION.match(line.strip())), "")
    if found == spec.ray_version:
        return ""
    seen = f"has Ray {found}" if found else f"printed no Ray version ({output.strip()[-200:]!r})"
    return (f"the image {spec.image} {seen}, but kubernetes.ray_version is {spec.ray_version}: KubeRay builds the "
            f"pods' commands and probes for rayVersion. Set kubernetes.ray_version to the image's version, or "
            f"build the image on rayproject/ray-llm:{spec.ray_version} (Dockerfile, ARG RAY_VERSION)")


def _per_pod(settings: Settings) -> tuple[int, int]:
    """(GPUs, EFA interfaces) the largest engine pod requests."""
    pools = [settings.pool(role) for role in Role]
    gpus = max((pool.tensor_parallel_size for pool in pools if pool.device == "cuda"), default=0)
    return gpus, max(pool.placement.efa_devices for pool in pools)


def _plugin_blockers(plugin: dict[str, Any], node: dict[str, Any]) -> list[str]:
    """Why the plugin's pods can never run on ``node`` as the DaemonSet stands (empty when they can)."""
    name, pod_spec = node["metadata"]["name"], plugin["spec"]["template"]["spec"]
    blockers = []
    tolerations = _daemon_pod_tolerations(pod_spec)
    for taint in (node.get("spec") or {}).get("taints") or []:
        if (taint.get("effect") in _BLOCKING_EFFECTS and taint.get("key") not in TRANSIENT_TAINTS
                and not _tolerates(tolerations, taint)):
            shown = f"{taint['key']}={taint.get('value', '')}:{taint['effect']}"
            blockers.append(
                f"the EFA device plugin does not tolerate the taint {shown} of node {name}, {_NO_EFA}. "
                f"Fix: run `pdserve cloud up` again (its efa-device-plugin step adds "
                f"the toleration), or `kubectl -n {PLUGIN_NAMESPACE} patch daemonset {EFA_PLUGIN} --type merge -p "
                f"'{json.dumps({'spec': {'template': {'spec': {'tolerations': efa_plugin_tolerations()}}}})}'`")
    if not _affinity_allows(pod_spec.get("affinity") or {}, _labels(node)):
        instance_type = _labels(node).get("node.kubernetes.io/instance-type", "?")
        blockers.append(f"the EFA device plugin's node affinity leaves out node {name} ({instance_type}), {_NO_EFA}. "
                        "eksctl lists the instance types with EFA in that affinity: pick an EFA instance type "
                        "(eks.gpu_instance_type), use an eksctl that lists it, or set eks.efa: false and "
                        "placement.efa_devices: 0")
    return blockers


def _daemon_pod_tolerations(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The tolerations a DaemonSet's pods carry: its template's and those its controller adds."""
    added = [*DAEMON_POD_TOLERATIONS, *([HOST_NETWORK_TOLERATION] if pod_spec.get("hostNetwork") else [])]
    return [*(pod_spec.get("tolerations") or []), *added]


def _node_waits(node: dict[str, Any]) -> list[str]:
    """A node still coming up: not Ready, or carrying a taint its owner takes off once it is."""
    name = node["metadata"]["name"]
    conditions = {condition.get("type"): condition for condition in (node.get("status") or {}).get("conditions") or []}
    transient = [f"{taint['key']}:{taint.get('effect', '')}" for taint in (node.get("spec") or {}).get("taints") or []
                 if taint.get("key") in TRANSIENT_TAINTS]
    ready = conditions.get("Ready", {}).get("status", "True")
    if ready == "True" and not transient:
        return []
    return [f"{name} is coming up (Ready={ready}"
            + (f", tainted {', '.join(transient)}" if transient else "") + ")"]


def _plugin_waits(plugin_pods: list[dict[str, Any]], node: dict[str, Any]) -> list[str]:
    name = node["metadata"]["name"]
    phases = [(pod.get("status") or {}).get("phase", "Pending") for pod in plugin_pods
              if (pod.get("spec") or {}).get("nodeName") == name]
    return [] if "Running" in phases else [f"EFA device plugin on {name}: {', '.join(phases) or 'no pod yet'}"]


def _capacity_waits(node: dict[str, Any], *, gpus: int, efa: int) -> list[str]:
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    name = node["metadata"]["name"]
    waits = []
    for resource, needed in ((GPU_RESOURCE, gpus), (EFA_RESOURCE, efa)):
        offered = int(allocatable.get(resource, "0"))
        if offered < needed:
            waits.append(f"{name} offers {offered} {resource} of {needed}")
    return waits


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    """Kubernetes' rule (k8s.io/api core/v1 Toleration.ToleratesTaint)."""
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            continue
        if toleration.get("operator") == "Exists":
            if not toleration.get("key") or toleration["key"] == taint.get("key"):
                return True
        elif toleration.get("key") == taint.get("key") and toleration.get("value", "") == taint.get("value", ""):
            return True
    return False


def _affinity_allows(affinity: dict[str, Any], labels: dict[str, str]) -> bool:
    """Required node affinity: any term whose every expression matches (In, NotIn, Exists, DoesNotExist)."""
    required = (affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms") or []
    return not terms or any(all(_matches(expression, labels) for expression in term.get("matchExpressions") or [])
                            for term in terms)


def _matches(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
    return {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
            "Exists": key in labels, "DoesNotExist": key not in labels}.get(operator, False)


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = obj["metadata"].get("labels") or {}
    return labels
