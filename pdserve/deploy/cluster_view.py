"""Pure: kubectl's JSON for pods, nodes and the RayService -> the rows ``pdserve cloud status`` prints,
the engine pods it reads logs from, and why a Serve deployment failed.

No I/O; ``cloud_status.py`` fetches the JSON and prints the tables.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.deploy.eksctl import INSTANCE_TYPE_LABEL
from pdserve.deploy.pod_diagnosis import (
    DEPLOY_FAILED,
    UNHEALTHY,
    deployments_in,
    rayservice_readiness,
    serve_app_states,
)
from pdserve.deploy.rayservice import EFA_RESOURCE, GPU_RESOURCE
from pdserve.role import Role

Row = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Check:
    """One row of cloud status's checks table."""

    name: str
    result: str  # OK, FAIL or SKIPPED
    detail: str

POD_HEADER = ("POD", "READY", "STATUS", "RESTARTS", "NODE", "IP")
NODE_HEADER = ("NODE", "INSTANCE-TYPE", "ZONE", "READY", "GPU", "EFA")
APP_HEADER = ("APP", "STATUS")
_ZONE_LABEL = "topology.kubernetes.io/zone"
_COMPONENT_LABEL = "app.kubernetes.io/component"
_INSTANCE_LABEL = "app.kubernetes.io/instance"


def pod_rows(pods_json: str) -> list[Row]:
    """One row per pod of ``kubectl get pods -o json``: readiness, why it waits, and its node."""
    rows: list[Row] = []
    for pod in json.loads(pods_json).get("items", []):
        containers = pod.get("status", {}).get("containerStatuses") or []
        ready = sum(1 for container in containers if container.get("ready"))
        restarts = sum(int(container.get("restartCount", 0)) for container in containers)
        rows.append((pod["metadata"]["name"], f"{ready}/{len(pod['spec'].get('containers', []))}", _pod_state(pod),
                     str(restarts), pod["spec"].get("nodeName") or "<none>", pod.get("status", {}).get("podIP") or "-"))
    return rows


def node_rows(nodes_json: str) -> list[Row]:
    """One row per node of ``kubectl get nodes -o json`` with its GPU and EFA capacity: a GPU node
    showing 0 EFA lacks its EFA device plugin, and engines asking for EFA will not schedule there."""
    rows: list[Row] = []
    for node in json.loads(nodes_json).get("items", []):
        labels = node["metadata"].get("labels", {})
        capacity = node.get("status", {}).get("capacity", {})
        conditions = {item.get("type"): item.get("status") for item in node.get("status", {}).get("conditions", [])}
        rows.append((node["metadata"]["name"], labels.get(INSTANCE_TYPE_LABEL, "?"), labels.get(_ZONE_LABEL, "?"),
                     "Ready" if conditions.get("Ready") == "True" else "NotReady",
                     capacity.get(GPU_RESOURCE, "0"), capacity.get(EFA_RESOURCE, "0")))
    return rows


def app_rows(rayservice_json: str) -> tuple[bool, list[Row]]:
    """(is the RayService ready, one row per Serve application with its deployments' states)."""
    readiness = rayservice_readiness(rayservice_json)
    states = serve_app_states(json.loads(rayservice_json).get("status") or {})
    rows: list[Row] = [(name, state) for name, state in states.items()] or [("-", readiness.summary)]
    return readiness.is_ready, rows


def deployment_causes(rayservice_json: str) -> list[str]:
    """One line per Serve deployment that failed (DEPLOY_FAILED) or fails its health checks (UNHEALTHY),
    with the line of Serve's message that says why: an engine's ``pdserve preflight:`` line when it
    refused to start. The APP table shows only the state; this is what to fix."""
    status = json.loads(rayservice_json).get("status") or {}
    return deployments_in(status, states=(DEPLOY_FAILED,)) + deployments_in(status, states=(UNHEALTHY,))


def engine_pods(pods_json: str, *, instance: str) -> list[str]:
    """Names of the Running prefill and decode worker pods of deployment ``instance`` (kubernetes.name):
    the pods whose engines have logs to read."""
    roles = {role.value for role in Role}
    names = []
    for pod in json.loads(pods_json).get("items", []):
        labels = pod["metadata"].get("labels") or {}
        is_running = (pod.get("status") or {}).get("phase") == "Running"
        if labels.get(_INSTANCE_LABEL) == instance and labels.get(_COMPONENT_LABEL) in roles and is_running:
            names.append(str(pod["metadata"]["name"]))
    return names


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """kubectl-style: left-aligned columns three spaces apart, upper-case header."""
    table = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(row[column]) for row in table) for column in range(len(header))]
    return "\n".join("   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in table)


def _pod_state(pod: dict[str, Any]) -> str:
    """kubectl's STATUS: a waiting or terminated container's reason (ImagePullBackOff, ...) over the phase."""
    status = pod.get("status", {})
    for container in status.get("containerStatuses") or []:
        state = container.get("state", {})
        for phase in ("waiting", "terminated"):
            reason = state.get(phase, {}).get("reason")
            if reason:
                return str(reason)
    return str(status.get("phase", "Unknown"))
