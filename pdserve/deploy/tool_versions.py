"""Pure: the oldest eksctl, kubectl and helm ``cloud up`` works with, as preflight steps of seconds.

- eksctl 0.205.0: before it, eksctl read ``overrideBootstrapCommand`` into a NodeConfig type without
  ``containerd.baseRuntimeSpec`` (pkg/nodebootstrap/al2023.go:172-176 unmarshals into nodeadm's typed NodeConfig;
  v0.205.0's go.mod:30 moves nodeadm from 2024-05-08 to 2025-02-19), so the memlock limit was dropped silently and
  the engines failed 40 minutes in.
- kubectl within one minor version of the control plane (Kubernetes' version skew policy).
- helm 3.10.0: the first with ``--set-json``, which the KubeRay step uses.
"""

from __future__ import annotations

import json
import re
from functools import partial

from pdserve.cluster_config import EksSpec
from pdserve.deploy.steps import Step
from pdserve.errors import DeployError

EKSCTL_FLOOR = (0, 205, 0)
HELM_FLOOR = (3, 10, 0)
_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")
Version = tuple[int, int, int]


def version_steps(eks: EksSpec) -> list[Step]:
    """One step per tool: its version command, and a check against its floor."""
    kubectl_floor = kubectl_floor_for(eks)
    return [_step("eksctl", ("eksctl", "version"), EKSCTL_FLOOR, "https://eksctl.io/installation/", why="baseRuntimeSpec"),
            _step("kubectl", ("kubectl", "version", "--client", "--output", "json"), kubectl_floor,
                  "https://kubernetes.io/docs/tasks/tools/", why=f"one minor version from Kubernetes {eks.kubernetes_version}"),
            _step("helm", ("helm", "version", "--short"), HELM_FLOOR, "https://helm.sh/docs/intro/install/",
                  why="--set-json")]


def kubectl_floor_for(eks: EksSpec) -> Version:
    major, _, minor = eks.kubernetes_version.partition(".")
    return int(major), max(int(minor) - 1, 0), 0


def _step(tool: str, argv: tuple[str, ...], floor: Version, source: str, *, why: str) -> Step:
    shown = ".".join(map(str, floor))
    return Step(f"{tool}-version", argv, check_output=partial(version_problem, tool=tool, floor=floor, source=source),
                about=f"preflight: {tool} {shown} or newer ({why})")


def version_problem(output: str, *, tool: str, floor: Version, source: str) -> str:
    """'' when the version ``output`` shows is at least ``floor``."""
    text = output
    if tool == "kubectl":  # kubectl version --client -o json: clientVersion.gitVersion
        try:
            text = str(json.loads(output)["clientVersion"]["gitVersion"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DeployError(f"unexpected output from kubectl version: {exc!r}") from exc
    found = _VERSION.search(text)
    if found is None:
        return f"{tool} printed no version ({output.strip()[:100]!r}); install {tool} from {source}"
    version = (int(found[1]), int(found[2]), int(found[3]))
    if version >= floor:
        return ""
    return (f"{tool} is {'.'.join(map(str, version))}, older than {'.'.join(map(str, floor))}, the oldest `cloud up` "
            f"works with; install a newer one from {source}")
