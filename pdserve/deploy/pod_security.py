"""Pure: what every pod pdserve renders runs with: the image's non-root user, no privilege escalation, no
capabilities, a read-only root filesystem with an emptyDir where a process must write, and no ServiceAccount
token. No I/O.

No pod of a deployment calls the Kubernetes API: only KubeRay's autoscaler sidecar would, and in-tree autoscaling
is off (KubeRay 1.6.2 ray-operator/controllers/ray/common/pod.go, DefaultHeadPodTemplate, gives the head a
ServiceAccount only for it). None is privileged: EFA needs its device, which the device plugin mounts, and locked
memory, which the GPU nodes' NodeConfig lifts (eksctl.py), not privileges.
"""

from __future__ import annotations

from typing import Any

# The Ray images run as user ray, uid 1000, group users, gid 100 (ray-project/ray docker/base-deps/Dockerfile:
# RAY_UID, RAY_GID, USER $RAY_UID).
RAY_UID = 1000
RAY_GID = 100
TMP_VOLUME = "tmp"
TMP_MOUNT = "/tmp"
# HOME on the writable volume: vLLM, torch, Triton, CUDA, Hugging Face and pdserve keep their caches under ~
# (~/.cache, ~/.triton, ~/.nv, ~/.config). /home/ray itself holds the image's Python (anaconda3), so no volume
# can go there; Ray writes /tmp/ray.
HOME = f"{TMP_MOUNT}/home"


def pod_security() -> dict[str, Any]:
    """The pod-level fields: the image's user, the runtime's default seccomp profile, no ServiceAccount token."""
    return {
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RAY_UID, "runAsGroup": RAY_GID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }


def container_security(*, capabilities: tuple[str, ...] = ()) -> dict[str, Any]:
    """A container's securityContext: no escalation (the image's passwordless sudo stops working), every
    capability dropped but ``capabilities``, the root filesystem read-only."""
    dropped: dict[str, Any] = {"drop": ["ALL"]}
    if capabilities:
        dropped["add"] = list(capabilities)
    return {"allowPrivilegeEscalation": False, "capabilities": dropped, "readOnlyRootFilesystem": True}


def writable_volume() -> dict[str, Any]:
    """The emptyDir on the node's disk that takes what a container writes (Ray's session, caches, logs)."""
    return {"name": TMP_VOLUME, "emptyDir": {}}


def writable_mount() -> dict[str, Any]:
    return {"name": TMP_VOLUME, "mountPath": TMP_MOUNT}


def home_env() -> list[dict[str, Any]]:
    """HOME on the writable volume, for the caches every library keeps under ~."""
    return [{"name": "HOME", "value": HOME}]
