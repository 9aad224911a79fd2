"""Settings -> every Kubernetes object a pdserve deployment needs, in the order to apply them.

``kubernetes_settings`` derives the configuration the cluster runs, once; everything rendered
comes from it. Rendering is pure; ``write_manifests`` is the one function here that writes files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pdserve.config import Settings
from pdserve.deploy.k8s_names import (
    GATEWAY_PORT_NAME,
    RAY_HEAD_PORTS,
    RAY_HEAD_PRIVATE_PORTS,
    gateway_selector,
    gateway_service_name,
    object_labels,
    object_metadata,
)
from pdserve.deploy.k8s_secrets import secrets_note
from pdserve.deploy.monitoring import dashboard_config_map, engine_pod_monitor, gateway_pod_monitor
from pdserve.deploy.network_policy import network_policies
from pdserve.deploy.pod_env import CACHE_MOUNT
from pdserve.deploy.pod_security import TMP_MOUNT
from pdserve.deploy.rayservice import COMPILE_CACHE_DIR, rayservice
from pdserve.engine_config import KVTransferSpec, LaunchSpec, PoolSpec
from pdserve.engines.kv_link import has_gpudirect
from pdserve.errors import ConfigError
from pdserve.role import Role

# The Ray custom resource only the pods for gateway replicas offer, unless ray.gateway_resources names one:
HEAD_RESOURCE = "head"  # the head, for one replica
GATEWAY_RESOURCE = "gateway"  # the gateway worker group's pods, for more
# The pods' root filesystem is read-only: engine logs (and `pdserve up`'s run folder under them) on the writable volume.
ENGINE_LOG_DIR = f"{TMP_MOUNT}/pdserve/logs"
POLICIES_FILE = "networkpolicies.yaml"


def kubernetes_settings(settings: Settings) -> Settings:
    """The configuration as the cluster runs it; the RayService's Serve config carries exactly this.

    - EFA on the pools: NIXL moves KV over its LIBFABRIC backend (UCX does not drive EFA), and the KV
      buffer lives where ``eks.gpu_instance_type``'s EFA reads it: GPU memory on P-series, host memory
      elsewhere (a pod cannot tell: the EKS AMI loads its peermem module only on demand).
    - The gateway binds 0.0.0.0, so its Service reaches it from outside the head pod.
    - Engines keep vLLM's compiled model on the node's cache volume (``kubernetes.model_cache_path``), and their
      logs on the pods' writable volume (``launch.log_dir``, default ``ENGINE_LOG_DIR``).
    - A pool without custom resources asks for ``{<role>: 1}``, which only its worker group
      offers; a gateway without them asks for ``{head: 1}``, which only the head offers, or with
      ``gateway.replicas`` > 1 for ``{gateway: 1}``, which only the gateway worker group offers.

    Raises ConfigError if EFA is on one pool only, gateway.port is one of Ray's ports on the head,
    several gateway replicas would sit behind KubeRay's head Service (``upgrade: new_cluster``), or
    launch.log_dir or launch.cache_dir is not where the pods may write.
    """
    check_gateway_port(settings)
    check_gateway_replicas(settings)
    check_writable_dirs(settings)
    efa = is_efa_on(settings)
    pools = {role.value: _placed_pool(settings, role) for role in Role}
    gateway_resources = settings.ray.gateway_resources or {
        HEAD_RESOURCE if settings.gateway.replicas == 1 else GATEWAY_RESOURCE: 1.0}
    return settings.model_copy(update={
        **pools,
        "kv": _efa_kv(settings) if efa else settings.kv,
        "gateway": settings.gateway.model_copy(update={"host": "0.0.0.0"}),
        "launch": _cluster_launch(settings),
        "ray": settings.ray.model_copy(update={"gateway_resources": gateway_resources}),
    })


def render_manifests(settings: Settings) -> list[dict[str, Any]]:
    """Namespace, the NetworkPolicies (before any pod exists, so none is ever open), RayService, the gateway's
    Service and, unless turned off, the PodMonitors of the gateway and the engines and the Grafana dashboard's
    ConfigMap (deploy/monitoring.py)."""
    cluster = kubernetes_settings(settings)
    objects = [namespace(cluster), *network_policies(cluster), rayservice(cluster)]
    if cluster.kubernetes.upgrade == "recreate":  # else KubeRay's head Service fronts the gateway
        objects.append(gateway_service(cluster))
    if cluster.kubernetes.pod_monitor:
        objects += [gateway_pod_monitor(cluster), engine_pod_monitor(cluster)]
    if cluster.kubernetes.grafana_dashboard:
        objects.append(dashboard_config_map(cluster))
    return objects


def render_yaml(settings: Settings) -> str:
    """Every object as one multi-document YAML stream, ready for ``kubectl apply -f -``, after a comment
    naming the Secrets the pods require."""
    return secrets_comment(settings) + "---\n".join(to_yaml(obj) for obj in render_manifests(settings))


def write_manifests(settings: Settings, out_dir: Path) -> list[Path]:
    """The objects in ``out_dir`` (created), one file each but the NetworkPolicies, which share one, named so
    that sorting them is the apply order; the first (the Namespace) opens with the comment naming the Secrets
    the pods require. Returns each object's file, in order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    objects = render_manifests(settings)
    paths = _manifest_paths(objects, out_dir)
    for path in dict.fromkeys(paths):
        documents = [to_yaml(obj) for obj, at in zip(objects, paths, strict=True) if at == path]
        path.write_text((secrets_comment(settings) if path == paths[0] else "") + "---\n".join(documents))
    return paths


def _manifest_paths(objects: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """``NN-<kind>.yaml`` per object, NN counting files by tens; a run of NetworkPolicies shares one file."""
    names: list[str] = []
    for obj in objects:
        kind = obj["kind"].lower()
        if kind == "networkpolicy" and names and names[-1].endswith(POLICIES_FILE):
            names.append(names[-1])
        else:
            names.append(f"{len(set(names)) * 10:02d}-{POLICIES_FILE if kind == 'networkpolicy' else kind + '.yaml'}")
    return [out_dir / name for name in names]


def secrets_comment(settings: Settings) -> str:
    """``k8s_secrets.secrets_note`` as YAML comment lines."""
    return "".join(f"# {line}\n" for line in secrets_note(settings))


def resource_ref(obj: dict[str, Any]) -> str:
    """How kubectl names an object: ``rayservice.ray.io/pdserve``, ``service/pdserve-gateway``."""
    group = obj["apiVersion"].rpartition("/")[0]
    kind = obj["kind"].lower() + (f".{group}" if group else "")
    return f"{kind}/{obj['metadata']['name']}"


def namespace(settings: Settings) -> dict[str, Any]:
    spec = settings.kubernetes
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": spec.namespace, "labels": object_labels(spec, "namespace")}}


def gateway_service(settings: Settings) -> dict[str, Any]:
    """ClusterIP in front of the gateway replicas' pods: the cluster's OpenAI endpoint."""
    spec = settings.kubernetes
    port = {"name": GATEWAY_PORT_NAME, "port": settings.gateway.port, "targetPort": GATEWAY_PORT_NAME,
            "protocol": "TCP"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(spec, gateway_service_name(spec), "gateway"),
        "spec": {"type": "ClusterIP", "selector": gateway_selector(spec), "ports": [port]},
    }


def check_gateway_port(settings: Settings) -> None:
    """The gateway replica binds its port on the Ray head, next to Ray's own servers: raises ConfigError
    when gateway.port is one of theirs."""
    taken = {port: name for name, port in (RAY_HEAD_PORTS | RAY_HEAD_PRIVATE_PORTS).items()}
    port = settings.gateway.port
    if port in taken:
        raise ConfigError(f"gateway.port: {port} is Ray's {taken[port]} port on the head; "
                          f"pick another, e.g. 9000 (Ray uses {sorted(taken)})")


def check_writable_dirs(settings: Settings) -> None:
    """The pods write only to their writable volume and the node's cache: raises ConfigError for a launch.log_dir
    or launch.cache_dir elsewhere (the root filesystem is read-only, pod_security.py)."""
    writable = [TMP_MOUNT, *([CACHE_MOUNT] if settings.kubernetes.model_cache_path else [])]
    for name, path in (("log_dir", settings.launch.log_dir), ("cache_dir", settings.launch.cache_dir)):
        if path and not any(Path(path).is_relative_to(root) for root in writable):
            raise ConfigError(f"launch.{name}: {path} is on the pods' read-only root filesystem; on Kubernetes give a "
                              f"path under {' or '.join(writable)}, or leave it empty")


def check_gateway_replicas(settings: Settings) -> None:
    """Several gateway replicas need their own Service: raises ConfigError for ``upgrade: new_cluster``."""
    if settings.gateway.replicas > 1 and settings.kubernetes.upgrade == "new_cluster":
        raise ConfigError("gateway.replicas > 1 needs kubernetes.upgrade: recreate: with new_cluster, clients reach "
                          "the gateway through KubeRay's head Service, which fronts the head pod only")


def is_efa_on(settings: Settings) -> bool:
    """Both pools or neither: KV moves from every prefill engine to every decode engine. Raises
    ConfigError when EFA is on one pool only."""
    with_efa = {role for role in Role if settings.pool(role).placement.efa_devices}
    if len(with_efa) == 1:
        (role,) = with_efa
        raise ConfigError(f"{role.value}.placement.efa_devices: EFA is on the {role.value} pool only; "
                          "prefill and decode engines need the same KV transport, so set both or neither")
    return bool(with_efa)


def _cluster_launch(settings: Settings) -> LaunchSpec:
    """vLLM's compiled model on the node's cache volume, where a replaced engine pod finds it; engine logs on the
    pods' writable volume."""
    launch = settings.launch
    update = {} if launch.log_dir else {"log_dir": ENGINE_LOG_DIR}
    if settings.kubernetes.model_cache_path and not launch.cache_dir:
        update["cache_dir"] = COMPILE_CACHE_DIR
    return launch.model_copy(update=update)


def _efa_kv(settings: Settings) -> KVTransferSpec:
    kv = settings.kv
    buffer = kv.buffer_device
    if buffer == "auto":
        buffer = "cuda" if has_gpudirect(settings.eks.gpu_instance_type) else "cpu"
    return kv.model_copy(update={"backends": ["LIBFABRIC"], "buffer_device": buffer})


def _placed_pool(settings: Settings, role: Role) -> PoolSpec:
    pool = settings.pool(role)
    if pool.placement.resources:
        return pool
    placement = pool.placement.model_copy(update={"resources": {role.value: 1.0}})
    return pool.model_copy(update={"placement": placement})


class _BlockStyleDumper(yaml.SafeDumper):
    """Writes multi-line strings (serveConfigV2) as readable ``|`` blocks, not escaped one-liners."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_BlockStyleDumper.add_representer(str, _represent_str)


def to_yaml(obj: dict[str, Any]) -> str:
    """One object as YAML in the order built, multi-line strings as ``|`` blocks."""
    return yaml.dump(obj, Dumper=_BlockStyleDumper, sort_keys=False)
