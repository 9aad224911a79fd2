"""Pure: cluster-ready Settings -> the KubeRay RayService that runs ``pdserve.ray:app``. No I/O.

A CPU-only head (Ray head, Serve controller, the gateway replica) and one worker group per pool
with one engine per pod; with ``gateway.replicas`` > 1, a CPU worker group ``gateway`` of that many
pods takes the gateway replicas instead of the head. Placement is by Ray custom resources: each
group offers the resources its replicas ask for, so Serve can put a replica nowhere else.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdserve.cluster_config import KubernetesSpec
from pdserve.config import Settings
from pdserve.deploy.k8s_names import (
    ENGINE_PORT_NAME,
    GATEWAY_COMPONENT,
    GATEWAY_POD_LABEL,
    GATEWAY_PORT_NAME,
    HEAD_COMPONENT,
    RAY_HEAD_PORTS,
    RAY_NODE_PORTS,
    RAY_WORKER_PORTS,
    object_labels,
    object_metadata,
    ray_token_secret_name,
)
from pdserve.deploy.pod_env import (
    CACHE_MOUNT,
    cache_env,
    engine_env,
    engine_key_env,
    gateway_keys_env,
    hf_token_env,
    ray_auth_env,
)
from pdserve.deploy.pod_security import (
    RAY_GID,
    RAY_UID,
    container_security,
    home_env,
    pod_security,
    writable_mount,
    writable_volume,
)
from pdserve.deploy.serve import serve_config_yaml
from pdserve.engine_config import PoolSpec
from pdserve.role import Role

GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
SHM_VOLUME = "dshm"
CACHE_VOLUME = "model-cache"
COMPILE_CACHE_DIR = f"{CACHE_MOUNT}/vllm"
# A hash of the pods' spec on the RayService: `cloud up` replaces a RayService whose pods changed, since
# KubeRay's upgradeStrategy None leaves its cluster as it is (ray-operator rayservice_controller.go).
PODS_HASH_ANNOTATION = "pdserve.io/pods-hash"
UPGRADE_STRATEGIES = {"recreate": "None", "new_cluster": "NewCluster"}
# How often the engine's /health is asked, and how many misses make the pod NotReady.
READINESS_PERIOD_S = 5
READINESS_FAILURES = 3
# A gateway pod leaves its Service after one missed answer: clients then reach the other replicas.
GATEWAY_READINESS_PERIOD_S = 2


def rayservice(settings: Settings) -> dict[str, Any]:
    """The RayService for ``settings`` (already derived by ``k8s.kubernetes_settings``)."""
    spec = settings.kubernetes
    cluster = {
        "rayVersion": spec.ray_version,
        "enableInTreeAutoscaling": False,  # Serve replica counts come from the pools
        # The operator needs the token too: it reads Serve's status from the dashboard.
        "authOptions": {"mode": "token", "secretName": ray_token_secret_name(spec)},
        "headGroupSpec": _head_group(settings),
        "workerGroupSpecs": [*_gateway_groups(settings), *(_worker_group(settings, role) for role in Role)],
    }
    metadata = object_metadata(spec, spec.name, "rayservice")
    metadata["annotations"] = {PODS_HASH_ANNOTATION: pods_hash(cluster)}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": metadata,
        "spec": {
            # KubeRay's default, NewCluster, starts a second cluster beside the first and moves over once it
            # serves: with fixed GPU node groups its engine pods are never scheduled and the upgrade hangs.
            "upgradeStrategy": {"type": UPGRADE_STRATEGIES[spec.upgrade]},
            "serveConfigV2": serve_config_yaml(settings),
            "rayClusterConfig": cluster,
        },
    }


def pods_hash(cluster: dict[str, Any]) -> str:
    """A short digest of a rayClusterConfig: equal digests, the same pods."""
    return hashlib.sha256(json.dumps(cluster, sort_keys=True).encode()).hexdigest()[:16]


def ray_resources_param(resources: dict[str, float]) -> str:
    """``rayStartParams.resources`` in the quoted form KubeRay passes through a shell unchanged."""
    amounts = {name: int(amount) if amount.is_integer() else amount for name, amount in resources.items()}
    return '"' + json.dumps(amounts, sort_keys=True).replace('"', '\\"') + '"'


def _head_group(settings: Settings) -> dict[str, Any]:
    spec, has_gateway = settings.kubernetes, settings.gateway.replicas == 1
    params = ray_params(**{"num-gpus": "0"})
    if has_gateway and settings.ray.gateway_resources:
        params["resources"] = ray_resources_param(settings.ray.gateway_resources)
    ports = [{"name": name, "containerPort": port} for name, port in RAY_HEAD_PORTS.items()]
    container = _ray_container(
        spec, name="ray-head", env=[*ray_auth_env(spec), *(_gateway_env(settings) if has_gateway else [])],
        ports=[*ports, {"name": GATEWAY_PORT_NAME, "containerPort": settings.gateway.port}],
        resources=_resources(cpus=spec.head_cpus, memory_gib=spec.head_memory_gib, devices={}),
    )
    pod = _pod([container], nodeSelector=dict(spec.head_node_labels))
    template = {"metadata": _gateway_pod_metadata(settings, HEAD_COMPONENT, has_gateway=has_gateway), "spec": pod}
    return {"rayStartParams": params, "template": template}


def _gateway_groups(settings: Settings) -> list[dict[str, Any]]:
    """With ``gateway.replicas`` > 1: one CPU pod per replica on the head's nodes, each Ready while
    its gateway answers, so the gateway Service sends clients only to replicas that serve."""
    spec, replicas = settings.kubernetes, settings.gateway.replicas
    if replicas == 1:
        return []
    container = _ray_container(
        spec, name="ray-worker", env=[*ray_auth_env(spec), *_gateway_env(settings)],
        ports=[{"name": GATEWAY_PORT_NAME, "containerPort": settings.gateway.port}],
        resources=_resources(cpus=spec.head_cpus, memory_gib=spec.head_memory_gib, devices={}),
    )
    container["readinessProbe"] = {"httpGet": {"path": "/health", "port": GATEWAY_PORT_NAME},
                                   "periodSeconds": GATEWAY_READINESS_PERIOD_S,
                                   "timeoutSeconds": GATEWAY_READINESS_PERIOD_S, "failureThreshold": 1}
    pod = _pod([container], nodeSelector=dict(spec.head_node_labels))
    return [{
        "groupName": GATEWAY_COMPONENT,
        "replicas": replicas, "minReplicas": replicas, "maxReplicas": replicas,
        "rayStartParams": ray_params(**{"num-gpus": "0",
                                        "resources": ray_resources_param(settings.ray.gateway_resources)}),
        "template": {"metadata": _gateway_pod_metadata(settings, GATEWAY_COMPONENT, has_gateway=True), "spec": pod},
    }]


def _gateway_pod_metadata(settings: Settings, component: str, *, has_gateway: bool) -> dict[str, Any]:
    """A pod's labels; on one that runs a gateway replica, the label its Service and PodMonitor select
    and the annotations for a Prometheus that discovers pods by annotation rather than a PodMonitor."""
    labels = object_labels(settings.kubernetes, component)
    if not has_gateway:
        return {"labels": labels}
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(settings.gateway.port),
              "prometheus.io/path": "/metrics"}
    return {"labels": {**labels, GATEWAY_POD_LABEL: "true"}, "annotations": scrape}


def _worker_group(settings: Settings, role: Role) -> dict[str, Any]:
    spec, pool = settings.kubernetes, settings.pool(role)
    placement = pool.placement
    params = {"resources": ray_resources_param(placement.resources)} if placement.resources else {}
    env = [*ray_auth_env(spec), *engine_env(pool, backends=settings.kv.backends), *engine_key_env(spec),
           *hf_token_env(spec), *cache_env(spec)]
    container = _ray_container(
        spec, name="ray-worker", env=env,
        # One engine per pod, so its replica binds the pool's base_port (ray/engine_replica.py).
        ports=[{"name": ENGINE_PORT_NAME, "containerPort": pool.base_port}],
        resources=_resources(cpus=placement.cpus, memory_gib=placement.memory_gib, devices=_devices(pool)),
    )
    container["volumeMounts"] += [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}, *_cache_mounts(spec)]
    # Without a probe of its own, KubeRay 1.6 gives a RayService worker one on Serve's proxy
    # (localhost:8000/-/healthz), which runs on the head only here: the pod would never be Ready.
    # Ready means what this pod is for: its engine answers.
    container["readinessProbe"] = {"httpGet": {"path": "/health", "port": ENGINE_PORT_NAME},
                                   "periodSeconds": READINESS_PERIOD_S, "timeoutSeconds": READINESS_PERIOD_S,
                                   "failureThreshold": READINESS_FAILURES}
    shm = {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": _memory(spec.shm_gib)}}
    pod = _pod([container], volumes=[shm, *_cache_volumes(spec)])
    if spec.model_cache_path:
        pod["initContainers"] = [_cache_owner(spec)]
    if placement.node_labels:
        pod["nodeSelector"] = dict(placement.node_labels)
    if pool.device == "cuda":
        pod["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "groupName": role.value,
        "replicas": pool.engines,
        "minReplicas": pool.engines,
        "maxReplicas": pool.engines,
        "rayStartParams": ray_params(**params),
        "template": {"metadata": {"labels": object_labels(spec, role.value)}, "spec": pod},
    }


def ray_params(**params: str) -> dict[str, str]:
    """``rayStartParams`` with Ray's own ports pinned (k8s_names.RAY_NODE_PORTS, RAY_WORKER_PORTS), the ones
    the NetworkPolicies let Ray pods reach on each other."""
    return {**{name: str(port) for name, port in (RAY_NODE_PORTS | RAY_WORKER_PORTS).items()}, **params}


def _ray_container(spec: KubernetesSpec, *, name: str, env: list[dict[str, Any]], ports: list[dict[str, Any]],
                   resources: dict[str, Any]) -> dict[str, Any]:
    """A Ray container of the image, locked down (pod_security.py), HOME and /tmp on its writable volume."""
    return {"name": name, "image": spec.image, "imagePullPolicy": "IfNotPresent", "env": [*env, *home_env()],
            "ports": ports, "resources": resources, "securityContext": container_security(),
            "volumeMounts": [writable_mount()]}


def _pod(containers: list[dict[str, Any]], *, volumes: tuple[dict[str, Any], ...] | list[dict[str, Any]] = (),
         **fields: Any) -> dict[str, Any]:
    """A Ray pod: no ServiceAccount token, the image's user, the writable volume beside ``volumes``."""
    return {**pod_security(), **fields, "containers": containers, "volumes": [writable_volume(), *volumes]}


def _gateway_env(settings: Settings) -> list[dict[str, Any]]:
    """A gateway replica reads its client and admin keys and presents the engine key to every engine."""
    spec = settings.kubernetes
    return [*gateway_keys_env(spec, is_open=settings.access.open), *engine_key_env(spec)]


def _cache_mounts(spec: KubernetesSpec) -> list[dict[str, Any]]:
    return [{"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT}] if spec.model_cache_path else []


def _cache_volumes(spec: KubernetesSpec) -> list[dict[str, Any]]:
    if not spec.model_cache_path:
        return []
    return [{"name": CACHE_VOLUME, "hostPath": {"path": spec.model_cache_path, "type": "DirectoryOrCreate"}}]


def _cache_owner(spec: KubernetesSpec) -> dict[str, Any]:
    """Hands the node's cache directory (the kubelet creates it root's, mode 0755) to the image's user alone,
    mode 0700: no other user of the node reads or writes the weights or the compiled model (code vLLM loads).
    Root with CAP_CHOWN and CAP_FOWNER only (the second for chmod once the image's user owns it: a re-run)."""
    owner = f"chown {RAY_UID}:{RAY_GID} {CACHE_MOUNT} && chmod 0700 {CACHE_MOUNT}"
    return {"name": "cache-owner", "image": spec.image, "imagePullPolicy": "IfNotPresent", "command": ["sh", "-c", owner],
            "securityContext": {**container_security(capabilities=("CHOWN", "FOWNER")), "runAsUser": 0,
                                "runAsNonRoot": False},
            "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT}]}


def _devices(pool: PoolSpec) -> dict[str, int]:
    devices = {GPU_RESOURCE: pool.tensor_parallel_size} if pool.device == "cuda" else {}
    if pool.placement.efa_devices:
        devices[EFA_RESOURCE] = pool.placement.efa_devices
    return devices


def _resources(*, cpus: float, memory_gib: float, devices: dict[str, int]) -> dict[str, Any]:
    """Requests equal to limits: Ray sizes its node from them and the pod is never overcommitted."""
    amounts: dict[str, Any] = {"cpu": _cpu(cpus), "memory": _memory(memory_gib), **devices}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _cpu(cpus: float) -> str:
    return str(int(cpus)) if cpus.is_integer() else f"{round(cpus * 1000)}m"


def _memory(gib: float) -> str:
    return f"{int(gib)}Gi" if gib.is_integer() else f"{round(gib * 1024)}Mi"
