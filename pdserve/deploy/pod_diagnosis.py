"""Pure: why a deployment's pods are not up yet, from one ``kubectl get rayservices,pods,events,nodes -o json``.

``cloud up`` looks once per poll and prints the cause of anything Pending or failing; a cause that
cannot go away by itself (no node offers what a pod requests, an image that cannot be pulled, an engine
that refused to start) stops the wait at once with its fix. No I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pdserve.deploy.rayservice import EFA_RESOURCE, GPU_RESOURCE
from pdserve.deploy.steps import Readiness
from pdserve.engines.start_failure import advice, root_cause

# kube-scheduler's FitError: "0/3 nodes are available: 1 node(s) didn't match Pod's node affinity/selector,
# 2 Insufficient vpc.amazonaws.com/efa. preemption: ..." (pkg/scheduler/framework/types.go, FitError.Error)
_FIT_ERROR = re.compile(r"\d+/\d+ nodes are available: (?P<reasons>.*?)(?:\. preemption:|\.?$)", re.DOTALL)
_INSUFFICIENT = re.compile(r"^\d+ Insufficient (?P<resource>\S+)$")
_NO_MATCH = re.compile(r"^\d+ node\(s\) didn't match Pod's node affinity/selector$")
_UNTOLERATED = re.compile(r"^\d+ node\(s\) had untolerated taint \{(?P<key>[^:}]*)")
# Taints of a node that is still coming up, which their owners take off by themselves: the node lifecycle
# controller's not-ready and unreachable (pkg/controller/nodelifecycle/node_lifecycle_controller.go,
# nodeConditionToTaintKeyStatusMap: removed once the node is Ready), and the cloud provider's uninitialized,
# which the kubelet sets at registration with an external cloud provider and the cloud controller manager
# removes once it has initialised the node (k8s.io/cloud-provider api/well_known_taints.go, TaintExternalCloudProvider;
# controllers/node/node_controller.go). A pod kept off such a node waits: it is no blocker.
TRANSIENT_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable",
                    "node.cloudprovider.kubernetes.io/uninitialized")
# The waiting reasons the kubelet gives a container whose image it cannot get: its own
# (kubernetes pkg/kubelet/images/types.go) and the two its image manager takes from the runtime's error
# (pkg/kubelet/images/image_manager.go evalCRIPullErr, k8s.io/cri-api/pkg/errors). The kubelet retries a pull
# with back-off, but a missing image, a registry that refuses the node or a name it cannot parse stays so.
IMAGE_PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                      "ImageInspectError", "RegistryUnavailable", "SignatureValidationFailed")
# A pull that failed on the way, not at the registry's answer: a connection reset or timed out, a stream cut short
# (containerd's "read: connection reset by peer", "i/o timeout", "unexpected EOF"), or the registry shedding load
# (ECR's throttling, HTTP 429 "toomanyrequests: Rate exceeded", or a 503). The kubelet pulls again with back-off
# (pkg/kubelet/images/image_manager.go) and a 10 GB image often needs it: waited for, not a blocker.
TRANSIENT_PULL_MARKS = ("connection reset by peer", "i/o timeout", "TLS handshake timeout", "unexpected EOF",
                        "429 Too Many Requests", "toomanyrequests", "Rate exceeded", "503 Service Unavailable")
IMAGE_PULL_FIX = ("the node cannot pull kubernetes.image: push the image, check its name and tag, and that the "
                  "node role may pull from its registry")
_FIXES = {
    EFA_RESOURCE: "no node offers vpc.amazonaws.com/efa: the EFA device plugin (DaemonSet aws-efa-k8s-device-plugin "
                  "in kube-system) does not run on the GPU nodes, or they have no EFA interfaces (eks.efa); see "
                  "`kubectl -n kube-system get pods -l name=aws-efa-k8s-device-plugin -o wide`",
    GPU_RESOURCE: "no node offers nvidia.com/gpu: the NVIDIA device plugin does not run on the GPU nodes; see "
                  "`kubectl get nodes -o custom-columns=NODE:.metadata.name,GPU:.status.allocatable.nvidia\\.com/gpu`",
}
# Serve's state of a deployment whose replicas failed to start too often: it does not retry.
DEPLOY_FAILED = "DEPLOY_FAILED"
# One whose replicas fail their health checks: Serve keeps replacing them.
UNHEALTHY = "UNHEALTHY"


@dataclass(frozen=True, slots=True)
class PodProblem:
    pod: str
    cause: str
    fix: str = ""  # set when the cause cannot go away by itself

    @property
    def line(self) -> str:
        return f"pod {self.pod}: {self.cause}" + (f"\n    fix: {self.fix}" if self.fix else "")


def diagnose(list_json: str, *, rayservice_name: str) -> Readiness:
    """Ready when the RayService is; otherwise where it stands, each pod problem on a line of its own,
    and a ``blocker`` when one of them, or a Serve deployment that failed, cannot resolve by itself."""
    items: list[dict[str, Any]] = json.loads(list_json).get("items", [])
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for item in items:
        by_kind.setdefault(item.get("kind", ""), []).append(item)
    services = [item for item in by_kind.get("RayService", []) if item["metadata"]["name"] == rayservice_name]
    if not services:
        return Readiness(is_ready=False, summary=f"RayService {rayservice_name} not created yet")
    readiness = rayservice_readiness(json.dumps(services[0]))
    if readiness.is_ready:
        return readiness
    problems = pod_problems(by_kind.get("Pod", []), events=by_kind.get("Event", []), nodes=by_kind.get("Node", []))
    failed = deployments_in(services[0].get("status") or {})
    summary = "\n".join([readiness.summary, *(problem.line for problem in problems), *failed])
    final = [problem.line for problem in problems if problem.fix] + failed
    return Readiness(is_ready=False, summary=summary, blocker="\n".join(final))


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


def deployments_in(rayservice_status: dict[str, Any], *, states: tuple[str, ...] = (DEPLOY_FAILED,)) -> list[str]:
    """Each Serve deployment in one of ``states``, with the line of its message that says why."""
    lines = []
    for service in ("activeServiceStatus", "pendingServiceStatus"):
        apps = (rayservice_status.get(service) or {}).get("applicationStatuses") or {}
        for app_name, app in apps.items():
            for name, deployment in (app.get("serveDeploymentStatuses") or {}).items():
                state = deployment.get("status")
                if state in states:
                    lines.append(f"deployment {app_name}/{name} {state}: {cause_line(deployment.get('message', ''))}")
    return lines


def cause_line(message: str) -> str:
    """The line of a Serve replica's failure message that names the cause: pdserve's own (an engine's
    preflight, or an engine that exited, named with the root cause of its log and pdserve's advice) if there
    is one, else the root cause of the traceback in the message (engines/start_failure.py), else its last line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    ours = [index for index, line in enumerate(lines) if "pdserve" in line and ("preflight" in line or "exited" in line)]
    cause = root_cause(message)
    if not ours:
        return _with_fix(cause.line, advice(cause)) if cause else (lines or ["(no message)"])[-1]
    index = ours[-1]
    line, rest = lines[index], lines[index + 1:]
    if line.endswith(":") and rest:  # an engine that exited with no cause named: its log's end follows
        return f"{line} ... {cause.line if cause else rest[-1]}"
    return f"{line}\n    {rest[0]}" if rest and rest[0].startswith("fix:") else line


def _with_fix(line: str, fix: str) -> str:
    return f"{line}\n    fix: {fix}" if fix else line


def pod_problems(pods: list[dict[str, Any]], *, events: list[dict[str, Any]], nodes: list[dict[str, Any]]) -> list[PodProblem]:
    """One problem per pod that is unschedulable or whose container cannot start."""
    problems = []
    for pod in pods:
        problem = container_problem(pod) or _scheduling_problem(pod, events=events, nodes=nodes)
        if problem is not None:
            problems.append(problem)
    return problems


def container_problem(pod: dict[str, Any]) -> PodProblem | None:
    """A container of ``pod`` that cannot start, init containers first: KubeRay's ``wait-gcs-ready`` on a
    worker runs the worker's image, so a bad image shows there while the Ray container is PodInitializing."""
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason, message = waiting.get("reason", ""), waiting.get("message", "")
        if reason in IMAGE_PULL_REASONS:
            is_transient = any(mark in message for mark in TRANSIENT_PULL_MARKS)
            return PodProblem(name, f"{reason}: {message}", fix="" if is_transient else IMAGE_PULL_FIX)
        if reason == "CreateContainerConfigError":
            return PodProblem(name, f"{reason}: {message}", fix="create what the pod refers to (a Secret or ConfigMap)")
        if reason == "CrashLoopBackOff":
            last = (container.get("lastState") or {}).get("terminated") or {}
            return PodProblem(name, f"{reason}: exit {last.get('exitCode', '?')} {last.get('reason', '')} "
                              f"{last.get('message', '')}".strip(),
                              fix=f"read its log: kubectl logs {name} --previous")
    return None


def _scheduling_problem(pod: dict[str, Any], *, events: list[dict[str, Any]], nodes: list[dict[str, Any]]) -> PodProblem | None:
    name = pod["metadata"]["name"]
    conditions = {condition.get("type"): condition for condition in (pod.get("status") or {}).get("conditions") or []}
    scheduled = conditions.get("PodScheduled", {})
    if scheduled.get("status") != "False":
        return None
    message = _latest_event_message(events, pod=name, reason="FailedScheduling") or scheduled.get("message", "")
    fit = _FIT_ERROR.search(message)
    reasons = [reason.strip() for reason in fit.group("reasons").split(", ")] if fit else []
    return PodProblem(name, f"Pending: {message.strip()}", fix=_scheduling_fix(pod, reasons, nodes))


def _scheduling_fix(pod: dict[str, Any], reasons: list[str], nodes: list[dict[str, Any]]) -> str:
    """The fix when no node could ever take the pod as the cluster stands (fixed node groups), else ''."""
    selector: dict[str, str] = pod["spec"].get("nodeSelector") or {}
    candidates = [node for node in nodes if selector.items() <= node["metadata"].get("labels", {}).items()]
    if not candidates or (reasons and all(_NO_MATCH.match(reason) or _is_lasting_taint(reason) for reason in reasons)):
        return (f"no node carries the labels {selector} and tolerates the pod: check the pools' placement.node_labels, "
                "kubernetes.head_node_labels and the node groups' labels and taints")
    requests = _requests(pod)
    for reason in reasons:
        insufficient = _INSUFFICIENT.match(reason)
        if insufficient is None:
            continue
        resource = insufficient.group("resource")
        offered = max(_quantity((node.get("status") or {}).get("allocatable", {}).get(resource, "0"))
                      for node in candidates)
        if offered < requests.get(resource, 0.0):
            return _FIXES.get(resource, f"the pod requests {_shown(resource, requests.get(resource, 0.0))} of "
                              f"{resource} but its nodes offer at most {_shown(resource, offered)}: lower "
                              "placement.cpus or placement.memory_gib, or use a larger instance type")
    return ""


def _is_lasting_taint(reason: str) -> bool:
    untolerated = _UNTOLERATED.match(reason)
    return untolerated is not None and untolerated.group("key") not in TRANSIENT_TAINTS


def _shown(resource: str, amount: float) -> str:
    return f"{amount / 2**30:.1f}Gi" if resource == "memory" else f"{amount:g}"


def _latest_event_message(events: list[dict[str, Any]], *, pod: str, reason: str) -> str:
    mine = [event for event in events if event.get("reason") == reason
            and (event.get("involvedObject") or {}).get("name") == pod]
    mine.sort(key=lambda event: event.get("lastTimestamp") or event.get("eventTime") or "")
    return str(mine[-1].get("message", "")) if mine else ""


def _requests(pod: dict[str, Any]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for container in pod["spec"].get("containers", []):
        for resource, amount in ((container.get("resources") or {}).get("requests") or {}).items():
            totals[resource] = totals.get(resource, 0.0) + _quantity(amount)
    return totals


_SUFFIXES = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _quantity(value: object) -> float:
    """A Kubernetes resource quantity (``24``, ``500m``, ``96Gi``) as a number."""
    text = str(value)
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    if match is None:
        return 0.0
    return float(match.group(1)) * _SUFFIXES.get(match.group(2), 1.0)

